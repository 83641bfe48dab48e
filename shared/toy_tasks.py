"""The toy tasks' multi-turn environments, which the rollout worker runs on the rows ``centerline
dataset`` writes (``centerline/toy/dataset.py``, the problems and the split); their single-turn
rows are scored by the built-in rewards of ``shared/rewards.py``.

``chain`` ("3+4 +5 +2" -> "7 2 4", a running sum's last digit over 2-4 chat turns) is
multi-turn: its rows run as sessions of the built-in environment ``chain`` (``ENVIRONMENTS``;
``centerline up --task chain --environment chain``). Turn 1's user message is the prompt's
first word ("3+4"), each later one the next word ("+5"); the model answers each with the last
digit of the running sum ("7", then "2", 12's). The next message depends on the model's answer:
after a wrong one the user restates the true value ("7+5" instead of "+5"), so the truth is
always in the conversation, an error does not compound and every step is judged against the
answer's word. The reward is the share of steps answered exactly (the reply, its
``<|im_end|>`` cut, equals the digit). ``calc`` is a three-digit sum through one tool, ``add``.

Used by the rollout worker (the built-in environments) and by the SFT warm start
(``centerline/toy/sft.py``: ``chain_turns``, the ``calc`` tool and budgets).
"""

from __future__ import annotations

import json


def chain_turns(prompt: str, answer: str) -> list[tuple[str, str, str]]:
    """A ``chain`` problem's steps: ``(message, restated, sum)``, the user message after a right
    answer, after a wrong one (the true sum restated), and the sum the step asks for."""
    words, sums = prompt.split(), answer.split()
    if len(words) != len(sums) or len(words) < 2:
        raise ValueError(f"a chain task's prompt {prompt!r} and answer {answer!r} must have one word per step, 2-4")
    restated = [words[0], *(before + word for before, word in zip(sums, words[1:]))]
    return list(zip(words, restated, sums))


async def chain(client, task) -> float:
    """The built-in environment of the ``chain`` task (``async def environment(client, task)``):
    one session through the OpenAI client, one turn per step; the share of steps right."""
    steps = chain_turns(task.prompt, task.answer)
    messages = [{"role": "user", "content": steps[0][0]}]
    right = 0
    for i, (_, _, want) in enumerate(steps):
        reply = await client.chat.completions.create(model="default", messages=messages, max_tokens=8)
        text = reply.choices[0].message.content or ""
        right += text == want
        messages.append({"role": "assistant", "content": text})
        if i + 1 < len(steps):
            message, restated, _ = steps[i + 1]
            messages.append({"role": "user", "content": message if text == want else restated})
    return right / len(steps)


# ``calc``'s one tool, in the form the ``openai`` SDK sends it; the model calls it in its chat
# template's format (the toy model's: hermes, ``<tool_call>{"name": "add", "arguments": {...}}</tool_call>``).
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "a + b",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
CALC_TURNS = 3  # requests per session: a call, its result answered, one retry of a bad call
CALC_MAX_TOKENS = 80  # a call to add of two 3-digit numbers: 75 tokens of the byte model, then <|im_end|>
CALC_ILL_FORMED = -1.0  # the reward of a session whose call markup did not parse (docs/results.md, "Tools")


def run_add(arguments: str) -> str:
    """The ``add`` tool on a call's ``arguments`` (OpenAI's JSON string): the sum, or what is wrong
    with the call, which the model reads as the tool's result (a tool error is data too)."""
    try:
        args = json.loads(arguments)
    except ValueError:
        return "error: arguments are not JSON"
    a, b = (args.get(k) if isinstance(args, dict) else None for k in ("a", "b"))
    if type(a) is not int or type(b) is not int:
        return "error: a and b must be integers"
    return str(a + b)


async def calc(client, task) -> float:
    """The built-in environment of the ``calc`` task: three-digit sums the byte model cannot do in its
    head, with one tool that does them (``ADD_TOOL``). Each reply that calls it gets the result as a
    ``role: "tool"`` message; the first reply without a call is the answer. Reward 1.0 for the
    answer exactly right, else 0.0; ``CALC_ILL_FORMED`` for a reply whose call markup did not parse
    (the endpoint names the failure in ``choices[0].tool_call_error``): ill-formed calls cost more
    than a wrong sum, so RL learns the format as well as the decision to call."""
    messages = [{"role": "user", "content": task.prompt}]
    for _ in range(CALC_TURNS):
        reply = await client.chat.completions.create(
            model="default", messages=messages, tools=[ADD_TOOL], max_tokens=CALC_MAX_TOKENS
        )
        if getattr(reply.choices[0], "tool_call_error", None):
            return CALC_ILL_FORMED
        message = reply.choices[0].message
        if not message.tool_calls:
            return float(message.content == task.answer)
        messages.append(message.model_dump())
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_add(call.function.arguments)})
    return 0.0


ENVIRONMENTS = {"chain": chain, "calc": calc}

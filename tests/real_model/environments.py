"""Environments of the real-model tests, named by ``module:function`` in a dataset row as a user's are."""

from __future__ import annotations

import json


async def capital_twice(client, task) -> float:
    """Two turns: the row's question, then a request to say it again; the reward is the share of
    the two replies that name the row's answer."""
    messages = [{"role": "user", "content": task.prompt}]
    first = await client.chat.completions.create(model="default", messages=messages, max_tokens=8)
    messages += [first.choices[0].message.model_dump(), {"role": "user", "content": "Say it once more."}]
    second = await client.chat.completions.create(model="default", messages=messages, max_tokens=8)
    return sum(task.answer.lower() in r.choices[0].message.content.lower() for r in (first, second)) / 2


ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
TOOL_SESSIONS: list[dict] = []  # per session of ``adds_with_a_tool``: its answers and the messages it sent last


def _shot(i: int, a: int, b: int) -> list[dict]:
    """One worked example: the question, the call (content null, as OpenAI answers a call), its result, the answer."""
    call = {"id": f"call_{i}", "type": "function", "function": {"name": "add", "arguments": f'{{"a": {a}, "b": {b}}}'}}
    return [
        {"role": "user", "content": f"What is {a} + {b}?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call_{i}", "content": str(a + b)},
        {"role": "assistant", "content": str(a + b)},
    ]


async def adds_with_a_tool(client, task) -> float:
    """Two worked examples of calling add, then the row's question, in the ``openai`` SDK's form: the
    reply's calls are run and sent back as tool messages after the assistant message as the client
    gives it (``model_dump()``); a reply without a call is asked once more to use the tool. The
    reward: 1 if the second reply names the answer."""
    messages = [
        {"role": "system", "content": "You are a calculator. To add numbers, always call the add tool first."},
        *_shot(0, 1, 1),
        *_shot(1, 4, 4),
        {"role": "user", "content": task.prompt},
    ]
    first = await client.chat.completions.create(model="default", messages=messages, tools=[ADD], max_tokens=40)
    messages.append(first.choices[0].message.model_dump())
    for call in first.choices[0].message.tool_calls or []:
        arguments = json.loads(call.function.arguments)
        result = str(sum(v for v in arguments.values() if isinstance(v, int)))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    if not first.choices[0].message.tool_calls:
        messages.append({"role": "user", "content": "Use the add tool."})
    second = await client.chat.completions.create(model="default", messages=messages, tools=[ADD], max_tokens=16)
    TOOL_SESSIONS.append({"answers": [first, second], "messages": messages})
    return float(task.answer in (second.choices[0].message.content or ""))

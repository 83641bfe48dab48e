"""Environments the session tests name as ``module:function`` (rollout_worker/environment.py)."""

from __future__ import annotations

import json

import openai

from shared.toy_tasks import ADD_TOOL

RECORDED: list[dict] = []  # one entry per session run: its final messages and what each turn answered


async def three_turns(client: openai.AsyncOpenAI, task) -> float:
    """Three turns of chat, a user message between them, and one attempt to edit the past (which
    the session refuses by name); the reward is the replies' total length, in characters."""
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": task.prompt}]
    answers, refused = [], None
    for then in ("And then?", "Thanks.", None):
        reply = await client.chat.completions.create(model="default", messages=messages, max_tokens=8)
        answers.append(reply)
        messages = [*messages, reply.choices[0].message.model_dump()]
        if then == "Thanks.":
            edited = [{**messages[1], "content": task.prompt + "!"}, *messages[2:]]
            try:
                await client.chat.completions.create(model="default", messages=[messages[0], *edited])
            except openai.BadRequestError as exc:
                refused = exc
        if then is not None:
            messages.append({"role": "user", "content": then})
    RECORDED.append({"messages": messages, "answers": answers, "refused": refused})
    return float(sum(len(a.choices[0].message.content) for a in answers))


async def no_turn(client: openai.AsyncOpenAI, task) -> float:
    return 1.0


async def one_turn(client: openai.AsyncOpenAI, task) -> float:
    reply = await client.chat.completions.create(model="default", messages=[{"role": "user", "content": task.prompt}])
    return float(len(reply.choices[0].message.content))


async def shrugs_off_errors(client: openai.AsyncOpenAI, task) -> float:
    """Catches what the endpoint answers and returns a reward anyway."""
    try:
        await client.chat.completions.create(model="default", messages=[{"role": "user", "content": task.prompt}])
    except openai.APIError:
        pass
    return 1.0


async def raises(client: openai.AsyncOpenAI, task) -> float:
    await one_turn(client, task)
    raise RuntimeError("the environment broke")


async def returns_nan(client: openai.AsyncOpenAI, task) -> float:
    await one_turn(client, task)
    return float("nan")


def not_async(client, task) -> float:
    return 0.0


AFTER_FIRST_TURN: list = []  # what ``three_turns_with_a_fault`` calls after a session's first turn (a test's fault)


async def three_turns_with_a_fault(client: openai.AsyncOpenAI, task) -> float:
    """Three turns; after the first, each callable in ``AFTER_FIRST_TURN`` runs (a test kills something there)."""
    messages = [{"role": "user", "content": task.prompt}]
    for turn in range(3):
        reply = await client.chat.completions.create(model="default", messages=messages, max_tokens=8)
        messages += [reply.choices[0].message.model_dump(), {"role": "user", "content": "And then?"}]
        if turn == 0:
            for fault in AFTER_FIRST_TURN:
                fault()
    return 1.0


CAUGHT: list[tuple[int, str | None]] = []  # (status, code) of each error ``swallows_a_refusal`` caught


async def swallows_a_refusal(client: openai.AsyncOpenAI, task) -> float:
    """Two turns; an error answered for the second is caught and the session finished with a reward
    anyway (as an environment that handles ``context_length_exceeded`` would)."""
    messages = [{"role": "user", "content": task.prompt}]
    reply = await client.chat.completions.create(model="default", messages=messages, max_tokens=4)
    messages += [reply.choices[0].message.model_dump(), {"role": "user", "content": "And then?"}]
    try:
        await client.chat.completions.create(model="default", messages=messages, max_tokens=4)
    except openai.APIStatusError as exc:
        CAUGHT.append((exc.status_code, exc.code))
    return 1.0


RETURNS: list = []  # what ``returns_given`` returns: a test sets it


async def returns_given(client: openai.AsyncOpenAI, task):
    await one_turn(client, task)
    return RETURNS[0]


ADD = ADD_TOOL  # the built-in calc task's tool
TOOL_TURNS: list[list] = []  # one entry per session run of ``calls_a_tool``: each answer, in order


async def calls_a_tool(client: openai.AsyncOpenAI, task) -> float:
    """An agent as the ``openai`` SDK's function calling is written: the add tool offered; each call the
    model makes is run and its result sent back as a tool message, the assistant message with its
    tool_calls as the client gives it (``model_dump()``), until a reply calls no tool (at most three
    turns). The reward: 1 if the last reply names the sum of the last call, else 0."""
    messages = [{"role": "user", "content": task.prompt}]
    answers, total = [], None
    for _ in range(3):
        reply = await client.chat.completions.create(model="default", messages=messages, tools=[ADD], max_tokens=48)
        answers.append(reply)
        message = reply.choices[0].message
        messages.append(message.model_dump())
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments)
            total = int(arguments.get("a", 0)) + int(arguments.get("b", 0))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(total)})
    TOOL_TURNS.append(answers)
    content = answers[-1].choices[0].message.content or ""
    return float(total is not None and str(total) in content)


BASE_URLS: list[str] = []  # each session's base URL, as its environment saw it
AGENT = """
import json, sys, urllib.request
body = json.dumps({"model": "default", "messages": [{"role": "user", "content": sys.argv[2]}]}).encode()
request = urllib.request.Request(sys.argv[1] + "chat/completions", body, {"Content-Type": "application/json"})
print(json.load(urllib.request.urlopen(request))["choices"][0]["message"]["content"])
"""


async def records_its_base_url(client: openai.AsyncOpenAI, task) -> float:
    BASE_URLS.append(str(client.base_url))
    return await one_turn(client, task)


async def hands_its_base_url_to_an_agent(client: openai.AsyncOpenAI, task) -> float:
    """Gives its session's base URL to an agent in another process (Python's urllib, as a CLI agent
    would get it: ``session_transport = "loopback"``); the reward is the length of the agent's answer."""
    import asyncio
    import sys

    base = str(client.base_url)
    BASE_URLS.append(base)
    agent = await asyncio.create_subprocess_exec(
        sys.executable, "-c", AGENT, base, task.prompt, stdout=asyncio.subprocess.PIPE
    )
    said, _ = await agent.communicate()
    if agent.returncode != 0:
        raise RuntimeError(f"the agent exited {agent.returncode}")
    return float(len(said.decode().rstrip("\n")))

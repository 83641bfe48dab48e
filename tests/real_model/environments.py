"""Environments of the real-model tests, named by ``module:function`` in a dataset row as a user's are."""

from __future__ import annotations


async def capital_twice(client, task) -> float:
    """Two turns: the row's question, then a request to say it again; the reward is the share of
    the two replies that name the row's answer."""
    messages = [{"role": "user", "content": task.prompt}]
    first = await client.chat.completions.create(model="default", messages=messages, max_tokens=8)
    messages += [first.choices[0].message.model_dump(), {"role": "user", "content": "Say it once more."}]
    second = await client.chat.completions.create(model="default", messages=messages, max_tokens=8)
    return sum(task.answer.lower() in r.choices[0].message.content.lower() for r in (first, second)) / 2

"""Environments the worker's fault tests name as ``module:function`` (rollout_worker/environment.py)."""

from __future__ import annotations

import asyncio

import openai


async def hangs_after_a_turn(client: openai.AsyncOpenAI, task) -> float:
    """One turn, then waits for something that never comes: it never returns."""
    await client.chat.completions.create(model="default", messages=[{"role": "user", "content": task.prompt}])
    await asyncio.Event().wait()
    return 1.0

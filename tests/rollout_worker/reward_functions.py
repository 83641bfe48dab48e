"""Reward functions the reward tests name as ``module:function`` (rollout_worker/rewards.py)."""

from __future__ import annotations

import asyncio
import threading
import time

EVENTS: list[tuple[str, str, float]] = []  # (task id, what happened, time.monotonic())
SLOW_STARTED = threading.Event()  # set when the slow task's reward has begun
OTHER_SCORED = threading.Event()  # set when the fast task's reward has run


def slow_sync(text: str, task) -> float:
    """A plain function that blocks (a sandbox, a judge called synchronously) until the other task
    of its worker was scored, or 30 s: on the event loop it would block that task forever."""
    EVENTS.append((task.task_id, "slow reward started", time.monotonic()))
    SLOW_STARTED.set()
    seen = OTHER_SCORED.wait(timeout=30)
    EVENTS.append((task.task_id, f"slow reward ended, other scored: {seen}", time.monotonic()))
    return 1.0


async def fast_async(text: str, task) -> float:
    """An async reward (a judge through an async client): awaited on the loop, once the slow
    reward of the other task has begun (so the two overlap by construction, if the loop is free)."""
    await asyncio.to_thread(SLOW_STARTED.wait, 30)
    EVENTS.append((task.task_id, "fast reward ran", time.monotonic()))
    OTHER_SCORED.set()
    return float(len(text))


def length(text: str, task) -> float:
    return float(len(text))


def starts_with_answer(text: str, task) -> float:
    return 1.0 if text.startswith(task.answer) else 0.0


def never_returns(text: str, task) -> float:
    threading.Event().wait(timeout=5)  # past the test's reward_timeout of 0.2 s
    return 0.0


async def never_returns_async(text: str, task) -> float:
    await asyncio.Event().wait()
    return 0.0


def fails(text: str, task) -> float:
    raise RuntimeError("judge unreachable")

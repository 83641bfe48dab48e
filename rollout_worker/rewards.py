"""Reward functions by name, scored off the event loop, and GRPO group advantages (docs/design.md section 6).

A task names its reward (``PromptTask.reward``): a built-in of the toy tasks (``exact``,
``prefix``; ``shared/rewards.py``) or ``"module:function"`` importable by the worker, or several
weighted components, ``"module:f=1.0,module:g=0.5"`` (``reward_spec``; ``centerline up --reward
module:f=1.0 --reward module:g=0.5``): the reward is the weighted sum, and each component's own
value is kept per sample (``Scores.components``, by the function's name) for the step's metrics.

Signature: ``reward(response_text: str, task: PromptTask) -> float``, or ``async def`` the same;
the text is the decoded response with the stop token already stripped. An ``async def`` reward is
awaited on the worker's event loop (an LLM judge through an async client); a plain function runs
in the worker's thread pool (``Scorer``: at most ``threads`` at once), so a slow one (a code
sandbox, a judge called synchronously) no longer stalls the worker's other tasks. Either is given
``timeout`` seconds per response; past it the task fails naming the reward (``RewardError``, the
task dead-lettered). A thread that timed out cannot be killed: it runs on, holding its thread.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from rollout_worker.user_code import load_function
from shared.rewards import REWARDS
from shared.task import PromptTask

RewardFn = Callable[[str, PromptTask], float]


class RewardError(ValueError):
    """A reward function that cannot be found, or that failed on a response."""


@dataclass(frozen=True)
class Component:
    name: str  # the function's name (a built-in's own): its metric, reward/<name>
    ref: str  # a built-in or "module:function"
    weight: float


def parse_components(spec: str) -> list[Component]:
    """The components of a task's reward ``spec``: ``"ref"`` (one, weight 1) or ``"ref=w,ref=w"``."""
    out = []
    for part in spec.split(","):
        ref, sep, weight = part.strip().rpartition("=") if "=" in part else (part.strip(), "", "1")
        try:
            value = float(weight)
        except ValueError:
            raise RewardError(
                f"reward {part!r}: weight {weight!r} is not a number; write module:function=0.5"
            ) from None
        if not math.isfinite(value):
            raise RewardError(f"reward {part!r}: weight {weight!r} is not finite; write module:function=0.5")
        if not ref:
            raise RewardError(f"reward {part!r} names no function; write a built-in or module:function, =weight after")
        out.append(Component(ref.rpartition(":")[2], ref, value))
    names = [c.name for c in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise RewardError(
            f"reward {spec!r}: two components are named {twice[0]!r} (a component is named by its function); "
            "give each function its own name"
        )
    return out


def reward_spec(rewards: list[str]) -> str:
    """The one string a task carries for ``up``'s ``--reward`` values: a lone unweighted reward as
    itself (``exact`` stays ``exact``: the held-out accuracy's), else ``ref=w,ref=w``. Checked."""
    if len(rewards) == 1 and "=" not in rewards[0]:
        parse_components(rewards[0])
        return rewards[0]
    spec = ",".join(r if "=" in r else f"{r}=1.0" for r in rewards)
    parse_components(spec)
    return spec


@functools.lru_cache(maxsize=64)
def load_reward(name: str) -> RewardFn:
    """The reward function ``name``: a built-in, or ``module:function``."""
    return load_function("reward", name, REWARDS, RewardError)


def load_components(spec: str) -> list[tuple[Component, RewardFn]]:
    """Every component of ``spec`` with its function, loaded as the worker loads them."""
    return [(c, load_reward(c.ref)) for c in parse_components(spec)]


@dataclass(frozen=True)
class Scores:
    total: np.ndarray  # float64 [n], the weighted sum of the components
    components: dict[str, list[float]]  # each component's own value per response, by its name


class Scorer:
    """Scores responses, ``async def`` rewards on the loop and plain ones in a pool of ``threads``,
    each call bounded by ``timeout`` seconds."""

    def __init__(self, threads: int = 8, timeout: float = 60.0):
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="reward")
        self.timeout = timeout

    async def score(self, task: PromptTask, texts: list[str]) -> Scores:
        """The reward of each response text. Raises ``RewardError`` naming the reward if one fails or times out."""
        try:
            parts = load_components(task.reward)
        except RewardError as exc:
            raise RewardError(f"task {task.task_id!r}: {exc}") from None
        values = await asyncio.gather(*(self._one(c, fn, task, text) for c, fn in parts for text in texts))
        n = len(texts)
        components = {c.name: [float(v) for v in values[i * n : (i + 1) * n]] for i, (c, _) in enumerate(parts)}
        total = np.zeros(n, dtype=np.float64)
        for c, _ in parts:
            total += c.weight * np.asarray(components[c.name], dtype=np.float64)
        return Scores(total, components)

    async def _one(self, component: Component, fn: RewardFn, task: PromptTask, text: str) -> float:
        try:
            if inspect.iscoroutinefunction(fn):
                value = await asyncio.wait_for(fn(text, task), self.timeout)
            else:
                call = asyncio.get_running_loop().run_in_executor(self.pool, fn, text, task)
                value = await asyncio.wait_for(call, self.timeout)
            return float(value)
        except TimeoutError:
            raise RewardError(
                f"reward {component.ref!r} timed out after {self.timeout:g}s on task {task.task_id!r}; make it faster "
                "or raise worker.reward_timeout"
            ) from None
        except Exception as exc:  # a user's function: any failure is reported with its name
            raise RewardError(
                f"reward {component.ref!r} failed on task {task.task_id!r}: {type(exc).__name__}: {exc}"
            ) from exc

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def score(task: PromptTask, texts: list[str]) -> np.ndarray:
    """The weighted reward of each response text, float64 [n], called here and now (tools, tests;
    the worker awaits ``Scorer.score``). Raises ``RewardError`` if a function fails."""
    total = np.zeros(len(texts), dtype=np.float64)
    for component, fn in load_components(task.reward):
        try:
            values = [fn(text, task) for text in texts]
            if values and inspect.isawaitable(values[0]):
                values = asyncio.run(_gather(values))
            total += component.weight * np.array([float(v) for v in values], dtype=np.float64)
        except Exception as exc:  # a user's function: any failure is reported with its name
            raise RewardError(
                f"reward {component.ref!r} failed on task {task.task_id!r}: {type(exc).__name__}: {exc}"
            ) from exc
    return total


async def _gather(awaitables):
    return await asyncio.gather(*awaitables)


def group_advantages(rewards: np.ndarray, *, std_norm: bool = False) -> np.ndarray:
    """GRPO: ``A_i = r_i - mean(r)`` over the group; with ``std_norm``, divided by the group's
    population standard deviation (a group with equal rewards keeps advantages 0)."""
    r = np.asarray(rewards, dtype=np.float64)
    adv = r - r.mean()
    if std_norm:
        std = r.std()
        adv = adv / std if std > 0 else np.zeros_like(adv)
    return adv

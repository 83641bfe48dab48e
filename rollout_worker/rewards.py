"""Reward functions by name, and GRPO group advantages (docs/design.md section 6).

A task names its reward function (``PromptTask.reward``): a built-in of the toy tasks
(``exact``, ``prefix``; ``shared/toy_tasks.py``) or ``"module:function"`` importable by the
worker. Signature: ``reward(response_text: str, task: PromptTask) -> float``; the text is
the decoded response with the stop token already stripped.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from rollout_worker.user_code import load_function
from shared.task import PromptTask
from shared.toy_tasks import REWARDS

RewardFn = Callable[[str, PromptTask], float]


class RewardError(ValueError):
    """A reward function that cannot be found, or that failed on a response."""


@functools.lru_cache(maxsize=64)
def load_reward(name: str) -> RewardFn:
    """The reward function ``name``: a built-in, or ``module:function``."""
    return load_function("reward", name, REWARDS, RewardError)


def score(task: PromptTask, texts: list[str]) -> np.ndarray:
    """The reward of each response text, float64 [n]. Raises ``RewardError`` if the function fails."""
    fn = load_reward(task.reward)
    try:
        return np.array([float(fn(text, task)) for text in texts], dtype=np.float64)
    except Exception as exc:  # a user's function: any failure is reported with its name
        raise RewardError(
            f"reward {task.reward!r} failed on task {task.task_id!r}: {type(exc).__name__}: {exc}"
        ) from exc


def group_advantages(rewards: np.ndarray, *, std_norm: bool = False) -> np.ndarray:
    """GRPO: ``A_i = r_i - mean(r)`` over the group; with ``std_norm``, divided by the group's
    population standard deviation (a group with equal rewards keeps advantages 0)."""
    r = np.asarray(rewards, dtype=np.float64)
    adv = r - r.mean()
    if std_norm:
        std = r.std()
        adv = adv / std if std > 0 else np.zeros_like(adv)
    return adv

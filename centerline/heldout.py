"""Held-out evaluation of tasks that name an environment: one session of it per held-out row.

`centerline up` measures a multi-turn task as it trains it: each held-out row becomes a task of
one sample, played by its environment through a loopback session endpoint and the proxy
(``rollout_worker/environment.py`` ``play``, what a worker runs), at the rollout temperature, and
scored by the reward the environment returns. The figure is the mean over the rows. A row whose
session fails (the engine, the proxy, the environment) fails the whole figure, logged by
``up``, rather than counting as a score.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from shared.config import Config
from shared.task import PromptTask

CONCURRENT_SESSIONS = 64  # sessions played at once: SGLang batches their turns


class SessionEvaluator:
    """The mean reward of one session per task of ``tasks`` (each names its environment)."""

    def __init__(self, model: Path, tasks: list[PromptTask]):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model))  # the workers' chat template
        self.tasks = tasks

    def __call__(self, cfg: Config, timeout: float) -> list[float]:
        """Each task's reward, in order; raises the worker's ``Transient`` or ``Rejected``."""
        return asyncio.run(self._play(cfg, timeout))

    async def _play(self, cfg: Config, timeout: float) -> list[float]:
        from rollout_worker.environment import play

        gate = asyncio.Semaphore(CONCURRENT_SESSIONS)

        async def one(http: aiohttp.ClientSession, task: PromptTask) -> float:
            async with gate:
                [(_, reward)] = await play(cfg, http, self.tokenizer, task, 1, timeout)
                return reward

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:
            return list(await asyncio.gather(*(one(http, task) for task in self.tasks)))

"""Prompt tasks from a JSONL dataset, in a deterministic order, published ahead of training.

A dataset line is ``{"prompt": str, "answer": str, "reward": str, ...}``; an ``environment``
(``"module:function"``) makes its tasks multi-turn sessions (docs/design.md section 12); every
other key goes into ``PromptTask.meta`` unchanged (the reward function sees it). Step ``s`` publishes
``prompts_per_step`` tasks, the dataset positions ``s * prompts_per_step + j`` of an
endless sequence of epochs, each epoch a permutation seeded by ``(seed, epoch)``. So the
tasks of a step are a pure function of ``(dataset, seed, step)``: after a restart the
trainer re-publishes the same tasks with the same ``task_id`` (= ``Nats-Msg-Id``), which
JetStream drops inside the PROMPTS duplicate window.

One sampling, one attempt number (docs/design.md section 10): each start of the trainer takes a
new block of attempt numbers for the tasks it publishes (``AttemptBlocks``, kept in the run
directory), so tasks published again after a restart, past the duplicate window, are sampled
under numbers no earlier copy uses; each publication of a task again takes one more.

The publisher never runs more than ``max_inflight_steps`` steps ahead of training
(``publish_until``), which bounds how stale a batch can be when it reaches a step. A task
whose batch the gate dropped as stale is published again (``resample``) in a block of its own,
one more time published again than the stale attempt's (``times_republished``),
under ``Nats-Msg-Id`` ``f"{task_id}/after-{attempt}"``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import orjson

from shared import names
from shared.nats_client import publish_acked
from shared.task import ATTEMPT_BLOCK, PromptTask

REQUIRED = ("prompt", "answer", "reward")
REPUBLISH_LEVELS = 10  # times a task may be published again that an attempt number can say (0 to 9)
log = logging.getLogger("centerline.trainer.tasks")


class DatasetError(ValueError):
    """A dataset file or line that cannot become prompt tasks; the message names file and line."""


@dataclass(frozen=True, slots=True)
class Example:
    prompt: str
    answer: str
    reward: str
    meta: dict
    environment: str = ""  # "module:function": the task runs n sessions of it

    def task(self, task_id: str, step: int, n: int, attempts_before: int, **more) -> PromptTask:
        """This example as the task ``task_id`` (its own group) of ``step``, ``n`` samples."""
        return PromptTask(
            task_id=task_id,
            group_id=task_id,
            prompt=self.prompt,
            answer=self.answer,
            reward=self.reward,
            n=n,
            step=step,
            meta=self.meta,
            environment=self.environment,
            attempts_before=attempts_before,
            **more,
        )


def load_dataset(path: str | Path) -> list[Example]:
    """Every line of ``path`` as an ``Example``; blank lines are skipped."""
    examples = []
    with open(path, "rb") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                doc = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{number}: not JSON ({exc})") from None
            if not isinstance(doc, dict):
                raise DatasetError(f"{path}:{number}: a line must be a JSON object, found {type(doc).__name__}")
            for key in REQUIRED:
                if not isinstance(doc.get(key), str):
                    raise DatasetError(
                        f"{path}:{number}: field {key!r} is {doc.get(key)!r}, expected a string "
                        f"(a line needs {', '.join(REQUIRED)}; `centerline dataset` writes them)"
                    )
            environment = doc.get("environment", "")
            if not isinstance(environment, str):
                raise DatasetError(
                    f"{path}:{number}: field 'environment' is {environment!r}, expected 'module:function'"
                )
            meta = {k: v for k, v in doc.items() if k not in (*REQUIRED, "environment")}
            examples.append(Example(doc["prompt"], doc["answer"], doc["reward"], meta, environment))
    if not examples:
        raise DatasetError(f"{path}: the dataset holds no examples")
    return examples


def attempts_base(block: int, republished: int) -> int:
    """``attempts_before`` of a publication in ``block`` of a task published again ``republished`` times
    before (below ``REPUBLISH_LEVELS``: ``--max-republishes`` is at most 9). Attempt 21001 reads: block 2,
    published again once, delivery 1."""
    return (block * REPUBLISH_LEVELS + republished) * ATTEMPT_BLOCK


def times_republished(attempt: int) -> int:
    """How many times the task of ``attempt`` had been published again before the publication that sampled it."""
    return (attempt - 1) // ATTEMPT_BLOCK % REPUBLISH_LEVELS


class AttemptBlocks:
    """The run's blocks of attempt numbers (``attempts_base``), each handed out once:
    the next free one is written to ``path`` (in the run directory) before a block is used, so no
    crash hands one out twice. ``first``: the block a run directory without the file starts at."""

    def __init__(self, path: Path, first: int = 0):
        self.path = path
        self.next = int(path.read_text()) if path.exists() else first

    def take(self) -> int:
        block, self.next = self.next, self.next + 1
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as fh:
            fh.write(f"{self.next}\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        return block


class TaskPublisher:
    """Turns steps into prompt tasks and publishes them; ``next_step`` is the data cursor saved in
    checkpoints. Takes a block of ``blocks`` for the tasks of this process, and one per task
    published again."""

    def __init__(
        self,
        examples: list[Example],
        *,
        run_id: str,
        seed: int,
        prompts_per_step: int,
        n: int,
        blocks: AttemptBlocks,
        next_step: int = 0,
    ):
        self.examples, self.run_id, self.seed = examples, run_id, seed
        self.prompts_per_step, self.n, self.next_step = prompts_per_step, n, next_step
        self._orders: dict[int, np.ndarray] = {}
        self.blocks = blocks
        self.attempts_before = attempts_base(blocks.take(), 0)
        self._again: set[str] = set()  # Nats-Msg-Ids of the tasks this process stored again

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: np.random.default_rng([self.seed, epoch]).permutation(len(self.examples))}
        return self._orders[epoch]

    def tasks(self, step: int) -> list[PromptTask]:
        out = []
        for j in range(self.prompts_per_step):
            position = step * self.prompts_per_step + j
            epoch, index = divmod(position, len(self.examples))
            ex = self.examples[int(self._order(epoch)[index])]
            out.append(ex.task(f"{self.run_id}/{step}/{j}", step, self.n, self.attempts_before))
        return out

    async def publish_until(self, js, trained_steps: int, inflight: int, last_step: int) -> int:
        """Publish the tasks of every step before ``min(trained_steps + inflight, last_step)``
        not yet published; returns how many tasks were sent."""
        sent = 0
        while self.next_step < min(trained_steps + inflight, last_step):
            sent += await self.publish_next(js)
        return sent

    async def publish_next(self, js) -> int:
        """Publish the tasks of step ``next_step`` and move the cursor on. Besides
        ``publish_until``, the trainer calls it when a step starves (its groups were given up
        by ``max_deliver`` or terminated by a worker), so that the run goes on with new data."""
        tasks = self.tasks(self.next_step)
        for task in tasks:
            await publish_acked(
                js,
                names.PROMPTS_SUBJECT,
                task.to_bytes(),
                {names.MSG_ID_HEADER: task.task_id},
                what=f"task {task.task_id!r}",
            )
        self.next_step += 1
        return len(tasks)

    def task(self, task_id: str) -> PromptTask | None:
        """The task ``task_id`` of this run (``f"{run_id}/{step}/{index}"``), None for any other id."""
        prefix = f"{self.run_id}/"
        step, sep, index = task_id.removeprefix(prefix).partition("/")
        if not task_id.startswith(prefix) or not (sep and step.isdigit() and index.isdigit()):
            return None
        if int(index) >= self.prompts_per_step:
            return None
        return self.tasks(int(step))[int(index)]

    async def resample(self, js, batch) -> bool:
        """Publish the task of ``batch`` (dropped as stale) again, in a new block; whether it was
        stored now. False, with a warning, for a task this run did not publish; False for one this
        process stored already (its stale part came back) or JetStream holds already (stored before a
        crash: the Nats-Msg-Id is the same). Raises ``PublishError`` when JetStream does not confirm it."""
        task = self.task(batch.task_id)
        if task is None:
            log.warning(
                "stale batch %s: its task %r is not one of this run's; not sampled again", batch.batch_id, batch.task_id
            )
            return False
        msg_id = f"{task.task_id}/after-{batch.attempt}"
        if msg_id in self._again:
            return False
        base = attempts_base(self.blocks.take(), times_republished(batch.attempt) + 1)
        ack = await publish_acked(
            js,
            names.PROMPTS_SUBJECT,
            replace(task, attempts_before=base).to_bytes(),
            {names.MSG_ID_HEADER: msg_id},
            what=f"task {task.task_id!r} again",
        )
        self._again.add(msg_id)
        if ack.duplicate:
            return False
        log.info(
            "task %s published again after its attempt %d was stale: attempts %d on",
            task.task_id,
            batch.attempt,
            base + 1,
        )
        return True

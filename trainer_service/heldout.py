"""Held-out evaluation in the loop (docs/design.md section 9): the trainer schedules it, the
workers sample it as they sample training tasks, the gate hands its batches here, never to a step.

Before training, every ``heldout_every`` steps and after the last, the trainer publishes one task per
held-out row (``--heldout-dataset``, the format of ``--dataset``): ``n`` 1, ``purpose``
"heldout", id ``f"{run_id}/heldout/{step}/{row}"`` (``heldout_id``), to ``prompts.tasks`` like any
task, so the same workers, proxy, router and engines sample it at the rollout settings (a row
naming an environment is one session of it). Its batch comes back on ``rollouts.batches``; the
gate knows it by its task id (``heldout_step``) and brings it here, whatever its age: it is
scored, never trained (``trainer_service/admission.py``).

A round is one step's evaluation. Each row counts once: the first complete attempt of its task
gives its reward; other attempts and redeliveries are dropped. Once every row has a reward the
round is recorded (``Metrics.heldout``: ``heldout_metrics.jsonl``, TensorBoard, Prometheus) as the held-out
figure of the step that scheduled it, labelled with the weight versions that sampled it. With a
rows directory (the trainer's ``<run-dir>/heldout``), each row's result is written there (fsynced)
as it comes and its batch acked at once, so a round of any size holds no batch unacked for long
(the consumer's ``max_ack_pending`` never stalls it); without one, a round's batches are acked once
it is recorded. A trainer restarted at step ``s`` reopens the round of ``s`` if it is due and
``heldout_metrics.jsonl`` lacks it (its rows written so far count); a round of an earlier step is given up,
never recorded: its rows would now be sampled by weights newer than the step it names
(``HeldoutRounds.reopen``). A round still short of rows ``heldout_timeout`` seconds after it was scheduled
is given up, logged, and not recorded; its late batches are dropped.

The figure is ``heldout_accuracy`` where every row is single-turn and scored by exact match (the
toy tasks' held-out accuracy), else ``heldout_reward``: the mean reward of one sample per row
(``shared/heldout_record.py``, the record's file and keys).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from shared import heldout_record, names
from shared.nats_client import publish_acked
from shared.task import PromptTask
from trainer_service.ledger import HeldPart
from trainer_service.tasks import Example

log = logging.getLogger("centerline.trainer.heldout")
HELDOUT = "heldout"  # PromptTask.purpose of a held-out task, and the part of its id after the run id
LATE, DUPLICATE_ROW = "heldout_late", "heldout_duplicate"  # the gate's drop rules of held-out batches


def heldout_id(run_id: str, step: int, row: int) -> str:
    return f"{run_id}/{HELDOUT}/{step}/{row}"


def heldout_step(task_id: str) -> int | None:
    """The step whose evaluation the task ``task_id`` belongs to; None for a task that is not held-out."""
    _, sep, rest = task_id.partition(f"/{HELDOUT}/")
    step, sep2, row = rest.partition("/")
    if not (sep and sep2 and "/" not in _ and step.isdigit() and row.isdigit()):
        return None
    return int(step)


def figure_name(examples: list[Example]) -> str:
    """``heldout_accuracy`` where every row is single-turn and scored by exact match, else ``heldout_reward``."""
    exact = all(ex.reward == "exact" and not ex.environment for ex in examples)
    return heldout_record.ACCURACY if exact else heldout_record.REWARD


@dataclass
class Round:
    """One step's evaluation: the rows' results so far and the parts to ack once it is recorded."""

    step: int
    version: int  # the trainer's weight version when it was scheduled
    started: float  # time.monotonic()
    results: dict[str, tuple[float, int]] = field(default_factory=dict)  # task_id -> (reward, weight version)
    attempts: dict[tuple[str, int], list[HeldPart]] = field(default_factory=dict)  # incomplete attempts' parts
    held: list[HeldPart] = field(default_factory=list)  # every part kept, acked once the round is recorded


class HeldoutRounds:
    """The held-out evaluation rounds of one trainer process: scheduled, filled with the rows'
    results as their batches come, recorded once complete (``record(figures)``, ``figures``' line)."""

    def __init__(
        self,
        examples: list[Example],
        *,
        run_id: str,
        attempts_before: int,
        every: int,
        timeout: float,
        record,
        rows_dir: Path | None = None,
    ):
        self.examples, self.run_id, self.attempts_before = examples, run_id, attempts_before
        self.every, self.timeout, self.record, self.name = every, timeout, record, figure_name(examples)
        self.rows_dir = rows_dir  # each row's result, durable before its batch is acked; None: acked per round
        self.rounds: dict[int, Round] = {}  # open rounds by step
        self.closed: set[int] = set()  # steps recorded or given up by this process, and those recorded before
        self.settled: list[HeldPart] = []  # parts of rows written to rows_dir, for the gate to ack

    def rows_path(self, step: int) -> Path | None:
        return None if self.rows_dir is None else self.rows_dir / f"{step}.jsonl"

    def write_row(self, step: int, task_id: str, reward: float, version: int) -> None:
        path = self.rows_path(step)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as fh:
            fh.write(orjson.dumps({"task_id": task_id, "reward": reward, "version": version}) + b"\n")
            fh.flush()
            os.fsync(fh.fileno())

    def load_rows(self, round_: Round) -> None:
        """The rows of ``round_`` written before a restart (a line cut short by a crash is left out)."""
        path = self.rows_path(round_.step)
        if path is None or not path.exists():
            return
        for line in path.read_bytes().splitlines():
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            round_.results[row["task_id"]] = (row["reward"], row["version"])

    def take_settled(self) -> list[HeldPart]:
        settled, self.settled = self.settled, []
        return settled

    def forget(self, round_: Round) -> None:
        """A round recorded or given up: its rows file goes (the record, or nothing, says what it was)."""
        path = self.rows_path(round_.step)
        if path is not None:
            path.unlink(missing_ok=True)

    def tasks(self, step: int) -> list[PromptTask]:
        return [
            ex.task(heldout_id(self.run_id, step, row), step, 1, self.attempts_before, purpose=HELDOUT)
            for row, ex in enumerate(self.examples)
        ]

    async def schedule(self, js, step: int, version: int) -> None:
        """Open the round of ``step`` and publish its tasks (``Nats-Msg-Id`` the task id: a round
        reopened inside JetStream's duplicate window is not sampled twice). Nothing for a step
        recorded already or open."""
        if step in self.closed or step in self.rounds:
            return
        self.rounds[step] = Round(step, version, time.monotonic())
        self.load_rows(self.rounds[step])
        for task in self.tasks(step):
            await publish_acked(
                js, names.PROMPTS_SUBJECT, task.to_bytes(), {names.MSG_ID_HEADER: task.task_id}, what="held-out task"
            )
        log.info("held-out evaluation of step %d scheduled: %d rows at version %d", step, len(self.examples), version)

    def recorded(self, run_dir: Path) -> None:
        """The steps whose figure the run's held-out record holds (``heldout_metrics.jsonl``, and an
        earlier release's ``eval.jsonl``) are closed: never evaluated again."""
        from trainer_service.metrics import complete_lines  # it imports torch, which this module needs nowhere else

        for path in (run_dir / heldout_record.OLD_FILE, run_dir / heldout_record.FILE):
            data = path.read_bytes() if path.exists() else b""
            self.closed.update(orjson.loads(line)["step"] for line in complete_lines(data)[0])

    def due(self, step: int, last: int) -> bool:
        """Whether the step ``step`` (completed steps; 0 before training) is evaluated."""
        return step % self.every == 0 or step == last

    async def reopen(self, js, step: int, version: int) -> None:
        """A trainer (re)started at ``step`` completed steps: schedule the round of ``step`` if it is
        due and the held-out record does not hold it (the first start: step 0's, before training). An
        earlier round the record lacks is given up: weights ``version`` would sample it, not those
        of the step it names."""
        for s in range(0, step, self.every):
            if s not in self.closed:
                log.warning(
                    "held-out evaluation of step %d given up: the trainer restarted at step %d, and weights newer "
                    "than step %d's would sample its rows; no figure recorded for it",
                    s,
                    step,
                    s,
                )
                self.closed.add(s)
                path = self.rows_path(s)
                if path is not None:
                    path.unlink(missing_ok=True)
        if step % self.every == 0:
            await self.schedule(js, step, version)

    def admit(self, held: HeldPart) -> str:
        """Keep a held-out part for its round: "" when kept (or a redelivery of a kept one), else the
        rule it is dropped under (``LATE``: its round is recorded, given up, or not this process's;
        ``DUPLICATE_ROW``: its row has a result from another attempt)."""
        batch = held.batch
        round_ = self.rounds.get(heldout_step(batch.task_id))
        if round_ is None:
            return LATE
        if any(h.seq == held.seq != 0 for h in round_.held) or any(
            h.seq == held.seq != 0 for parts in round_.attempts.values() for h in parts
        ):
            return ""  # a redelivery of a part kept: the kept copy gets acked
        if batch.task_id in round_.results:
            return DUPLICATE_ROW
        key = (batch.task_id, batch.attempt)
        parts = round_.attempts.setdefault(key, [])
        parts.append(held)
        if len(parts) < batch.parts:
            return ""
        del round_.attempts[key]
        rewards = [float(r) for h in parts for r in h.batch.rewards]
        result = (sum(rewards) / len(rewards), max(h.batch.weight_version for h in parts))
        round_.results[batch.task_id] = result
        if self.rows_dir is None:
            round_.held.extend(parts)
        else:
            self.write_row(round_.step, batch.task_id, *result)
            self.settled.extend(parts)
        return ""

    def finished(self, now: float) -> tuple[list[Round], list[Round]]:
        """Remove and return the rounds with a result for every row, and those past ``timeout`` without."""
        done = [r for r in self.rounds.values() if len(r.results) == len(self.examples)]
        expired = [r for r in self.rounds.values() if r not in done and now - r.started > self.timeout]
        for r in [*done, *expired]:
            del self.rounds[r.step]
            self.closed.add(r.step)
        return done, expired

    def figures(self, r: Round, now: float) -> dict:
        """The round's line of ``heldout_metrics.jsonl``: the figure, its rows, the trainer's version when it was
        scheduled, the weight versions that sampled its rows, and its seconds from scheduling to the last."""
        rewards = [reward for reward, _ in r.results.values()]
        versions = [version for _, version in r.results.values()]
        return {
            "step": r.step,
            self.name: sum(rewards) / len(rewards),
            "heldout_rows": len(rewards),
            "version": r.version,
            "heldout_version_min": min(versions),
            "heldout_version_max": max(versions),
            "heldout_s": round(now - r.started, 3),
        }

    def parts(self) -> list[HeldPart]:
        """Every part kept by an open round (for in-progress acks and a release)."""
        return [h for r in self.rounds.values() for h in (*r.held, *(h for p in r.attempts.values() for h in p))]

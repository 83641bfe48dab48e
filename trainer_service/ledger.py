"""The ledger of trained task groups and the parts the gate holds, without I/O: exactly once per
task group (docs/design.md section 10), shared by the trainer's gate (``admission.py``, ``gate.py``)
and ``centerline replay --train``.

A batch is one part of one attempt of a task (``task_id``, ``attempt``, ``parts``). An
attempt's parts are *pending* until all of them are there, then held *whole* for the step;
the step's commit writes each task to the ledger, ``task_id -> {"attempt", "step", "parts":
{batch_id: stream sequence}}``, saved in every checkpoint.

The ledger is bounded: it keeps the tasks of the last ``kept_task_steps`` task steps (a training
task's id names the step it was published for, ``run/step/index``: ``tasks.py``), far past the life
of a task's parts. A part of a task older than that is refused by name (``expired_task``,
``admission.py``), never looked up, so forgetting its entry cannot train it twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.wire import Batch


@dataclass(slots=True)
class HeldPart:
    """A part the gate holds: accepted, not yet trained, and the message to ack once its step is committed."""

    msg: object
    batch: Batch
    seq: int  # stream sequence of the message in ROLLOUTS


@dataclass(slots=True)
class Attempt:
    """The parts of one attempt of a task that arrived so far."""

    parts: dict[str, HeldPart] = field(default_factory=dict)  # batch_id -> part
    first: float = 0.0  # time.monotonic() when its first part arrived


# The fewest task steps the ledger keeps (``kept_task_steps``): a task's parts arrive within the steps in
# flight and its republishes, a few steps; these are hundreds.
LEDGER_TASK_STEPS = 256


def kept_task_steps(max_inflight_steps: int, max_staleness: int, weight_sync_interval: int = 1) -> int:
    """How many task steps of trained tasks the ledger keeps: ``LEDGER_TASK_STEPS``, or eight times
    the steps a task's parts may take to arrive (published ``max_inflight_steps`` ahead, stale
    ``max_staleness`` versions later), whichever is more."""
    return max(LEDGER_TASK_STEPS, 8 * (max_inflight_steps + 1 + (max_staleness + 1) * weight_sync_interval))


def first_kept_step(next_task_step: int, kept: int) -> int:
    """The oldest task step whose tasks the ledger keeps, with tasks published up to ``next_task_step``."""
    return max(0, next_task_step - kept)


def task_step(task_id: str) -> int | None:
    """The task step a training task was published for (``run/step/index``), None for any other id."""
    parts = task_id.split("/")
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


def kept_entries(ledger: dict[str, dict], first_step: int) -> dict[str, dict]:
    """``ledger`` without the tasks published before task step ``first_step`` (ids of no step stay)."""
    return {t: e for t, e in ledger.items() if (s := task_step(t)) is None or s >= first_step}


def ledger_entries(held: list[HeldPart], step: int) -> dict[str, dict]:
    """The ledger entries of the complete attempts ``held`` (every part of each), trained at ``step``."""
    out: dict[str, dict] = {}
    for h in held:
        entry = out.setdefault(h.batch.task_id, {"attempt": h.batch.attempt, "step": step, "parts": {}})
        entry["parts"][h.batch.batch_id] = h.seq
    return out


class GroupLedger:
    """Every task group the gate knows, by state: trained (``ledger``, saved in every checkpoint), held
    whole for the current step (``held``, ``whole``), and pending (``pending``: attempts still
    incomplete)."""

    def __init__(self, ledger: dict[str, dict], first_step: int = 0):
        self.ledger = ledger  # task_id -> {"attempt", "step", "parts": {batch_id: seq}}, saved in every checkpoint
        self.first_step = first_step  # parts of tasks published before this task step are expired_task
        self.held: dict[str, HeldPart] = {}  # batch_id -> part, of the attempts held whole, in arrival order
        self.whole: dict[str, int] = {}  # task_id -> the attempt held whole for the step
        self.pending: dict[tuple[str, int], Attempt] = {}  # (task_id, attempt) -> its parts so far

    def parts(self, task_id: str, attempt: int) -> dict[str, HeldPart]:
        if self.whole.get(task_id) == attempt:
            return {bid: h for bid, h in self.held.items() if h.batch.task_id == task_id}
        pending = self.pending.get((task_id, attempt))
        return pending.parts if pending else {}

    def hold(self, part: HeldPart, now: float) -> bool:
        """Keep an admitted part; True when it completes its attempt (then held for the step)."""
        key = (part.batch.task_id, part.batch.attempt)
        attempt = self.pending.setdefault(key, Attempt(first=now))
        attempt.parts[part.batch.batch_id] = part
        if len(attempt.parts) < part.batch.parts:
            return False
        del self.pending[key]
        self.held.update(attempt.parts)
        self.whole[key[0]] = key[1]
        return True

    def commit(self, step: int) -> tuple[list[HeldPart], list[HeldPart]]:
        """The step is durable: its tasks join the ledger. Returns the step's parts (to ack) and
        the pending parts of other attempts of those tasks (to drop)."""
        trained = list(self.held.values())
        self.ledger.update(ledger_entries(trained, step))
        superseded = [key for key in self.pending if key[0] in self.whole]
        dropped = [h for key in superseded for h in self.pending.pop(key).parts.values()]
        self.held, self.whole = {}, {}
        return trained, dropped

    def forget_before(self, first_step: int) -> list[HeldPart]:
        """Keep only the tasks of task step ``first_step`` on (``kept_entries``); returns the pending
        parts of older tasks, which the gate refuses as ``expired_task`` like any part of them."""
        self.first_step = max(self.first_step, first_step)
        self.ledger = kept_entries(self.ledger, self.first_step)
        old = [key for key in self.pending if (s := task_step(key[0])) is not None and s < self.first_step]
        return [h for key in old for h in self.pending.pop(key).parts.values()]

    def expired(self, now: float, after: float) -> list[HeldPart]:
        """Remove and return the parts of the attempts incomplete ``after`` seconds after their first part."""
        old = [key for key, attempt in self.pending.items() if now - attempt.first > after]
        return [h for key in old for h in self.pending.pop(key).parts.values()]

    def release(self) -> list[HeldPart]:
        """Abandon the step and every pending attempt: all their parts, for redelivery."""
        out = [*self.held.values(), *(h for a in self.pending.values() for h in a.parts.values())]
        self.held, self.whole, self.pending = {}, {}, {}
        return out

    def every_part(self) -> list[HeldPart]:
        return [*self.held.values(), *(h for a in self.pending.values() for h in a.parts.values())]

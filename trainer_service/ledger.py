"""The ledger of trained task groups and the parts the gate holds, without I/O: exactly once per
task group (docs/design.md section 10), shared by the trainer's gate (``admission.py``, ``gate.py``)
and ``centerline replay --train``.

A batch is one part of one attempt of a task (``task_id``, ``attempt``, ``parts``). An
attempt's parts are *pending* until all of them are there, then held *whole* for the step;
the step's commit writes each task to the ledger, ``task_id -> {"attempt", "step", "parts":
{batch_id: stream sequence}}``, saved in every checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.wire import Batch


@dataclass(slots=True)
class Held:
    """A part the gate holds: accepted, not yet trained, and the message to ack once its step is committed."""

    msg: object
    batch: Batch
    seq: int  # stream sequence of the message in ROLLOUTS


@dataclass(slots=True)
class Attempt:
    """The parts of one attempt of a task that arrived so far."""

    parts: dict[str, Held] = field(default_factory=dict)  # batch_id -> part
    first: float = 0.0  # time.monotonic() when its first part arrived


def ledger_entries(held: list[Held], step: int) -> dict[str, dict]:
    """The ledger entries of the complete attempts ``held`` (every part of each), trained at ``step``."""
    out: dict[str, dict] = {}
    for h in held:
        entry = out.setdefault(h.batch.task_id, {"attempt": h.batch.attempt, "step": step, "parts": {}})
        entry["parts"][h.batch.batch_id] = h.seq
    return out


class Groups:
    """Every task group the gate knows, by state: trained (the ledger), held whole for the current
    step, and pending (attempts still incomplete)."""

    def __init__(self, ledger: dict[str, dict]):
        self.ledger = ledger  # task_id -> {"attempt", "step", "parts": {batch_id: seq}}, saved in every checkpoint
        self.held: dict[str, Held] = {}  # batch_id -> part, of the attempts held whole, in arrival order
        self.whole: dict[str, int] = {}  # task_id -> the attempt held whole for the step
        self.pending: dict[tuple[str, int], Attempt] = {}  # (task_id, attempt) -> its parts so far

    def parts(self, task_id: str, attempt: int) -> dict[str, Held]:
        if self.whole.get(task_id) == attempt:
            return {bid: h for bid, h in self.held.items() if h.batch.task_id == task_id}
        pending = self.pending.get((task_id, attempt))
        return pending.parts if pending else {}

    def hold(self, part: Held, now: float) -> bool:
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

    def commit(self, step: int) -> tuple[list[Held], list[Held]]:
        """The step is durable: its tasks join the ledger. Returns the step's parts (to ack) and
        the pending parts of other attempts of those tasks (to drop)."""
        trained = list(self.held.values())
        self.ledger.update(ledger_entries(trained, step))
        superseded = [key for key in self.pending if key[0] in self.whole]
        dropped = [h for key in superseded for h in self.pending.pop(key).parts.values()]
        self.held, self.whole = {}, {}
        return trained, dropped

    def expired(self, now: float, after: float) -> list[Held]:
        """Remove and return the parts of the attempts incomplete ``after`` seconds after their first part."""
        old = [key for key, attempt in self.pending.items() if now - attempt.first > after]
        return [h for key in old for h in self.pending.pop(key).parts.values()]

    def release(self) -> list[Held]:
        """Abandon the step and every pending attempt: all their parts, for redelivery."""
        out = [*self.held.values(), *(h for a in self.pending.values() for h in a.parts.values())]
        self.held, self.whole, self.pending = {}, {}, {}
        return out

    def every_part(self) -> list[Held]:
        return [*self.held.values(), *(h for a in self.pending.values() for h in a.parts.values())]

"""Failpoints: named places in a service where a fault test makes the process fail exactly
there, the way a crash would, instead of hoping a timed SIGKILL lands at the right moment.

A failpoint is armed by the ``CENTERLINE_FAILPOINTS`` environment variable, read once at
import: a comma-separated list of ``name@step=action``::

    CENTERLINE_FAILPOINTS="trainer.after_checkpoint@3=kill"     SIGKILL this process at step 3
    CENTERLINE_FAILPOINTS="trainer.train@1=sleep:7"             sleep 7 s there, then go on

``@step`` may be left out (every pass). Unset, ``hit`` costs one dict lookup. The names
a service passes are listed in ``POINTS``, so a misspelt failpoint fails at start-up rather
than never firing.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

ENV = "CENTERLINE_FAILPOINTS"

# Every failpoint, in the order a trainer step passes them (trainer_service/service.py, policy.py).
POINTS = {
    "trainer.gathered": "rank 0, the step's batches are held, nothing trained",
    "trainer.train": "rank 0, inside the step after the optimizer update, nothing saved",
    "trainer.before_checkpoint": "rank 0, the step's weights version is written, its checkpoint not",
    "trainer.after_checkpoint": "rank 0, the checkpoint (ledger included) is durable, no batch acked",
    "trainer.after_acks": "rank 0, the step's batches are acked, the new weights not yet published",
    "trainer.weights_paused": "rank 0, an engine paused for the weight update (in_place or retract), not yet "
    "loaded or continued (@step: the version)",
    "trainer.broadcast": "rank 0, the first bucket of a version broadcast to an engine (--weight-transport "
    "distributed), the next not yet sent: the engine paused, in its weight update (@step: the version)",
    "trainer.stale": "rank 0, a batch found stale, its task not yet published again, nothing dead-lettered or acked",
    "trainer.rejected": "rank 0, a rejected batch is in the DLQ (a stale one's task published again), not yet acked",
    # a rollout worker (rollout_worker/worker.py); @step: the task's attempt
    "worker.between_parts": "a worker, one part of an attempt's split batch stored, the next not yet published",
    # a rollout worker's session (rollout_worker/worker.py Worker.sample_sessions); @step: the turn arriving (2, 3, ...)
    "worker.between_turns": "a worker, a session's earlier turns answered to its environment, the next turn's "
    "request received and not yet sent to the proxy",
}

log = logging.getLogger("centerline.faults")


class FailpointError(ValueError):
    """``CENTERLINE_FAILPOINTS`` names an unknown failpoint or action."""


def parse(text: str) -> dict[str, list[tuple[int | None, str]]]:
    armed: dict[str, list[tuple[int | None, str]]] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        where, sep, action = item.partition("=")
        name, _, step = where.partition("@")
        if not sep or name not in POINTS:
            raise FailpointError(f"{ENV}: {item!r}: expected name[@step]=action with a name among {sorted(POINTS)}")
        if action != "kill" and not (action.startswith("sleep:") and _is_number(action[6:])):
            raise FailpointError(f"{ENV}: {item!r}: the action must be kill or sleep:SECONDS")
        if step and not step.isdigit():
            raise FailpointError(f"{ENV}: {item!r}: the step after @ must be a whole number")
        armed.setdefault(name, []).append((int(step) if step else None, action))
    return armed


def _is_number(text: str) -> bool:
    try:
        return float(text) >= 0
    except ValueError:
        return False


ARMED = parse(os.environ.get(ENV, ""))


def hit(name: str, step: int | None = None) -> None:
    """Fail here if ``name`` is armed for ``step``."""
    if name not in ARMED:
        if name not in POINTS:
            raise FailpointError(f"failpoint {name!r} is not declared in shared.faults.POINTS")
        return
    for at, action in ARMED[name]:
        if at is None or at == step:
            log.warning("failpoint %s at step %s: %s", name, step, action)
            if action == "kill":
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(float(action[6:]))

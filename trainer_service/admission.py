"""The gate's decision on one message, a pure function of the message, the ledger and the trainer's
settings (docs/design.md section 10: exactly once per task group); ``gate.py`` acts on it over
NATS, ``centerline replay --train`` offline.

A candidate batch must pass the whole completeness contract (``shared.contract.check_batch``:
vocabulary from the model config, staleness against the trainer's current weight version), plus
one trainer-only rule, ``settings``: the batch was sampled with the mode, K, temperature, top-p
and top-k this trainer is configured for (a global batch has one of each).

A batch is one part of one attempt of a task (``task_id``, ``attempt``, ``parts``). A task's
group is admitted only when every part of one attempt is there; a truncated group is never
trained on. The ledger (``ledger.py``) maps ``task_id`` to ``{"attempt", "step", "parts":
{batch_id: stream sequence}}``.

- A redelivery of a trained part (same stream sequence: a crash between checkpoint and ack) is
  normal: ``DUPLICATE``. A *different* message carrying a trained or held ``batch_id``
  (re-published outside the duplicate window) is a producer defect: ``duplicate_batch``. A part
  of *another* attempt of a task trained, or held whole for the step, is ``DROP``
  (``duplicate_attempt``).
- A whole group (``parts`` 1) is ``rollout_n`` distinct samples, else ``group_size``.
- One attempt, one split (``split_conflict``): a new part of an attempt held whole, and a part of
  a split attempt (``parts`` > 1) whose samples are already held for it, or that would make it
  hold more than ``rollout_n`` samples, or complete its parts short of them. Two samplings never
  share an attempt number (``tasks.py``); should they, one group is trained from one of them,
  never from both.
- A held-out batch (its task is one of a held-out evaluation's, ``heldout.heldout_step``;
  docs/design.md section 9) never reaches a step, whatever the ledger or its age: checked against
  the contract but staleness, then ``HELDOUT``, for its round (``heldout.HeldoutRounds``).
- A batch of another run (its task id's first component is not this trainer's run id) is
  ``foreign_run`` before any check: runs on one NATS never mix.
- A part of a task published before the oldest task step the ledger keeps (``ledger.py``) is
  ``expired_task``, before the ledger is asked: whether it was trained is no longer known, so it is
  never trained and its task never published again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shared.contract import ContractViolation, check_batch
from shared.msgpack_arrays import WireError
from shared.wire import Batch, decode_batch
from trainer_service.heldout import heldout_step
from trainer_service.ledger import GroupLedger, HeldPart, task_step

DUPLICATE_ATTEMPT = "duplicate_attempt"
SPLIT_CONFLICT, FOREIGN_RUN = "split_conflict", "foreign_run"
GROUP_SIZE = "group_size"  # a whole (parts=1) batch that is not --rollout-n distinct samples
EXPIRED_TASK = "expired_task"  # a part of a task older than the ledger keeps


HOLD, DUPLICATE, IGNORE, DROP, REJECT = "hold", "duplicate", "ignore", "drop", "reject"
HELDOUT = "heldout"  # a held-out evaluation's batch: to its round, never to a step


@dataclass(frozen=True, slots=True)
class GateSettings:
    """What the contract checks a batch against besides the ledger: the model's vocabulary
    and the trainer's configuration (sampling settings, ``max_staleness``)."""

    vocab_size: int
    cfg: object  # shared.config.Config
    run_id: str = ""  # this trainer's run; "" accepts every run's batches (``centerline replay``)


def run_of(task_id: str) -> str:
    """The run a task id belongs to: its first component (``tasks.py``, ``heldout.heldout_id``)."""
    return task_id.partition("/")[0]


@dataclass(frozen=True, slots=True)
class Admission:
    """The gate's decision on one message; acting on it (hold, ack, drop, dead-letter) is the caller's."""

    # HOLD | DUPLICATE (a redelivery of a trained part) | IGNORE (of a held one) | DROP (another attempt) | REJECT
    # | HELDOUT (a held-out evaluation's)
    action: str
    batch_id: str
    batch: Batch | None = None  # None when the bytes are not a batch
    rule: str = ""  # DROP: duplicate_attempt; REJECT: the contract rule, or "wire"
    reason: str = ""


def admission(
    data: bytes, seq: int, version: int, *, groups: GroupLedger, settings: GateSettings, msg_id: str = ""
) -> Admission:
    """Decide what the gate does with the message ``data`` at stream sequence ``seq`` when the
    trainer holds weight version ``version``; a pure function of the message, ``groups`` (the
    ledger, held and pending parts) and the settings, shared by the trainer and
    ``centerline replay --train``.

    A part of a trained task is a redelivery (DUPLICATE) when it is of the trained attempt and
    the very message that was trained (same sequence; sequence 0 is a message recorded from the
    subject, which has none, and counts as that message); of another attempt it is DROP
    (``duplicate_attempt``), as is a part of another attempt of a task held whole for the step.
    A held or pending batch id with the same sequence is a redelivery of the held message
    (IGNORE). Any other repeat of a batch id is the contract's ``duplicate_batch`` (REJECT); a
    part that does not fit its attempt's held parts is ``split_conflict`` (REJECT, ``conflict``).
    Whatever the batch's age: the ledger is asked before the contract. A held-out evaluation's
    batch is HELDOUT, or REJECT where it breaks the contract (staleness aside) or ``settings``.
    """
    try:
        batch = decode_batch(data)
    except WireError as exc:
        return Admission(REJECT, msg_id, rule="wire", reason=str(exc))
    task, attempt, bid = batch.task_id, batch.attempt, batch.batch_id
    if settings.run_id and run_of(task) != settings.run_id:
        reason = (
            f"{bid!r} is of task {task!r}, of run {run_of(task)!r}; this trainer runs {settings.run_id!r} "
            "(a NATS shared with an earlier run still held its tasks): never trained here"
        )
        return Admission(REJECT, bid, batch, FOREIGN_RUN, reason)
    if heldout_step(task) is not None:  # scored, never trained: its age does not matter
        try:
            check_batch(batch, vocab_size=settings.vocab_size)
            check_settings(batch, settings.cfg)
        except ContractViolation as exc:
            return Admission(REJECT, bid, batch, exc.rule, str(exc))
        return Admission(HELDOUT, bid, batch)
    published = task_step(task)
    if published is not None and published < groups.first_step:
        reason = (
            f"{bid!r} is of task {task!r}, published for task step {published}; the ledger keeps the tasks of "
            f"task step {groups.first_step} on, so whether it was trained is no longer known: never trained"
        )
        return Admission(REJECT, bid, batch, EXPIRED_TASK, reason)
    trained = groups.ledger.get(task)
    if trained is not None:
        if trained["attempt"] != attempt:
            reason = f"task {task!r} was trained from attempt {trained['attempt']} at step {trained['step']}"
            return Admission(DROP, bid, batch, DUPLICATE_ATTEMPT, f"{bid!r} is of attempt {attempt}; {reason}")
        if trained["parts"].get(bid) == seq or (seq == 0 and bid in trained["parts"]):
            return Admission(DUPLICATE, bid, batch)
        return Admission(REJECT, bid, batch, "duplicate_batch", _repeat(bid, trained["parts"].get(bid), seq, task))
    whole = groups.whole.get(task)
    if whole is not None and whole != attempt:
        reason = f"{bid!r} is of attempt {attempt}; attempt {whole} of task {task!r} is held whole for this step"
        return Admission(DROP, bid, batch, DUPLICATE_ATTEMPT, reason)
    held = groups.parts(task, attempt)
    same = held.get(bid)
    if same is not None:
        if same.seq == seq != 0:
            return Admission(IGNORE, bid, batch)
        return Admission(REJECT, bid, batch, "duplicate_batch", _repeat(bid, same.seq, seq, task))
    if whole == attempt:
        reason = (
            f"{bid!r} is a part of attempt {attempt} of task {task!r}, held whole for this step as {sorted(held)}: "
            "two samplings carried one attempt number"
        )
        return Admission(REJECT, bid, batch, SPLIT_CONFLICT, reason)
    try:
        check(batch, version, settings=settings)
    except ContractViolation as exc:
        return Admission(REJECT, bid, batch, exc.rule, str(exc))
    known = next(iter(held.values()), None)
    if known is not None and known.batch.parts != batch.parts:
        reason = (
            f"{bid!r} says attempt {attempt} of task {task!r} has {batch.parts} parts, its part "
            f"{known.batch.batch_id!r} says {known.batch.parts}; one attempt's parts come from one split"
        )
        return Admission(REJECT, bid, batch, "shape", reason)
    if batch.parts > 1 and (reason := conflict(batch, list(held.values()), settings.cfg.rollout.n)):
        return Admission(REJECT, bid, batch, SPLIT_CONFLICT, reason)
    n, distinct = settings.cfg.rollout.n, len(set(batch.sample_ids))
    if batch.parts == 1 and not (batch.num_samples == distinct == n):
        reason = (
            f"{bid!r} is the whole group of attempt {attempt} of task {task!r} with {batch.num_samples} samples, "
            f"{distinct} of them distinct; a group is --rollout-n {n} distinct samples"
        )
        return Admission(REJECT, bid, batch, GROUP_SIZE, reason)
    return Admission(HOLD, bid, batch)


def conflict(batch: Batch, held: list[HeldPart], n: int) -> str:
    """Why part ``batch`` cannot join the parts ``held`` of its attempt as one split of one group
    of ``n`` samples, or ""; the first part of a sampling to arrive decides which split is held."""
    where = f"{batch.batch_id!r} (attempt {batch.attempt} of task {batch.task_id!r}, {batch.num_samples} samples)"
    others = f"its parts {[h.batch.batch_id for h in held]}"
    ids = {s for h in held for s in h.batch.sample_ids}
    twice = sorted(ids.intersection(batch.sample_ids))
    if twice:
        return f"{where} carries samples {twice} already held from {others}: two splits of the attempt"
    total = len(ids) + batch.num_samples
    if total > n:
        return f"{where} would make {others} hold {total} samples, above --rollout-n {n}: two splits of the attempt"
    if len(held) + 1 == batch.parts and total < n:
        return (
            f"{where} would complete the {batch.parts} parts of the attempt with {total} of its --rollout-n {n} "
            f"samples, with {others}: two splits of the attempt"
        )
    return ""


def _repeat(bid: str, first: int | None, seq: int, task: str) -> str:
    return (
        f"batch_id {bid!r} (task {task!r}) was already admitted from stream sequence {first}; the message at "
        f"sequence {seq} re-publishes it outside JetStream's duplicate window"
    )


def check(batch: Batch, version: int, *, settings: GateSettings) -> None:
    """Raise ``ContractViolation`` unless ``batch`` may join the current step: the whole
    contract (staleness against ``version``) and ``settings``."""
    check_batch(
        batch,
        vocab_size=settings.vocab_size,
        current_version=version,
        max_staleness=settings.cfg.training.max_staleness,
    )
    check_settings(batch, settings.cfg)


def check_settings(batch: Batch, cfg) -> None:
    """The trainer-only rule ``settings``: the batch was sampled as this trainer is configured."""
    want = {
        "mode": (cfg.rollout.logprobs_mode, "--rollout-logprobs-mode"),
        "k": (cfg.rollout.top_logprobs_num, "--rollout-top-logprobs-num"),
        "temperature": (cfg.rollout.temperature, "--rollout-temperature"),
        "top_p": (cfg.rollout.top_p, "--rollout-top-p"),
        "top_k": (cfg.rollout.top_k, "--rollout-top-k"),
    }
    for name, (value, flag) in want.items():
        found = getattr(batch, name)
        if found != value and not (isinstance(value, float) and math.isclose(found, value, rel_tol=1e-6)):
            raise ContractViolation(
                "settings",
                f"batch {batch.batch_id!r} was sampled with {name}={found!r}, the "
                f"trainer runs {flag} {value!r}; start workers and trainer with the same "
                "configuration",
                expected=value,
                found=found,
            )

"""The gate: what a candidate batch must pass to reach a training step, and the ledger of
batches already trained.

Rank 0 pulls ``rollouts.batches`` through the durable consumer ``names.TRAINER_CONSUMER``
and runs the whole completeness contract (``shared.contract.check_batch``: vocabulary from
the model config, staleness against the trainer's current weight version, the ledger of
trained ``batch_id``s), plus one trainer-only rule, ``settings``: the batch was sampled
with the mode, K, temperature, top-p and top-k this trainer is configured for (a global
batch has one of each).

- A rejected batch is published to ``rollouts.dlq`` as the same bytes, with ``rule``,
  ``reason`` and ``batch_id`` headers, then acked: it never blocks the stream.
  The DLQ message id is ``dlq/<stream sequence>``, so a redelivered reject is stored once.
- An accepted batch is *held* (unacked) until the step that trains it, the checkpoint and
  the ledger holding it are durable (``commit``). While held, ``keep_alive`` tells the
  server every ``ack_wait / 3`` that the trainer is still working on it.
- The ledger maps ``batch_id`` to ``[stream sequence, step]``. A redelivery of the very
  message that was trained (same stream sequence: a crash between checkpoint and ack) is
  normal and is acked silently, counted as ``duplicate``. A *different* message carrying a
  trained ``batch_id`` (re-published outside the duplicate window) is a producer defect
  and goes to the DLQ as ``duplicate_batch``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

from shared import faults, names
from shared.contract import ContractViolation, check_batch
from shared.nats_client import publish_acked
from shared.wire import ARRAY_FIELDS, Batch, WireError, decode_batch

log = logging.getLogger("centerline.trainer.gate")
REASON_MAX = 1024  # header bytes kept of a rejection reason


@dataclass(slots=True)
class Held:
    """An accepted batch and the message to ack once its step is committed."""

    msg: object
    batch: Batch
    seq: int  # stream sequence of the message in ROLLOUTS


HOLD, DUPLICATE, IGNORE, REJECT = "hold", "duplicate", "ignore", "reject"


@dataclass(frozen=True, slots=True)
class GateSettings:
    """What the contract checks a batch against besides the ledger: the model's vocabulary
    and the trainer's configuration (sampling settings, ``max_staleness``)."""

    vocab_size: int
    cfg: object  # shared.config.Config


@dataclass(frozen=True, slots=True)
class Admission:
    """The gate's decision on one message; acting on it (hold, ack, dead-letter) is the caller's."""

    action: str  # HOLD | DUPLICATE (a redelivery of a trained message) | IGNORE (of a held one) | REJECT
    batch_id: str
    batch: Batch | None = None  # None when the bytes are not a batch
    rule: str = ""  # REJECT: the contract rule, or "wire"
    reason: str = ""


def admission(
    data: bytes, seq: int, version: int, *, ledger: dict, held: dict, settings: GateSettings, msg_id: str = ""
) -> Admission:
    """Decide what the gate does with the message ``data`` at stream sequence ``seq`` when the
    trainer holds weight version ``version``; a pure function of the message, the ledger, the
    held batches and the settings, shared by the trainer and ``centerline replay --train``.

    A batch id already trained is a redelivery (DUPLICATE) only for the very message that was
    trained (same sequence); sequence 0 is a message recorded from the subject, which has none,
    and counts as that message. A held batch id with the same sequence is a redelivery of the
    held message (IGNORE). Any other repeat is the contract's ``duplicate_batch`` (REJECT).
    """
    try:
        batch = decode_batch(data)
    except WireError as exc:
        return Admission(REJECT, msg_id, rule="wire", reason=str(exc))
    try:
        check(batch, version, ledger=ledger, held=held, settings=settings)
    except ContractViolation as exc:
        if exc.rule == "duplicate_batch":
            trained = ledger.get(batch.batch_id)
            if trained is not None and seq in (trained[0], 0):
                return Admission(DUPLICATE, batch.batch_id, batch)
            if trained is None and batch.batch_id in held and held[batch.batch_id].seq == seq != 0:
                return Admission(IGNORE, batch.batch_id, batch)
        return Admission(REJECT, batch.batch_id, batch, exc.rule, str(exc))
    return Admission(HOLD, batch.batch_id, batch)


def check(batch: Batch, version: int, *, ledger: dict, held: dict, settings: GateSettings) -> None:
    """Raise ``ContractViolation`` unless ``batch`` may join the current step: the whole
    contract (staleness against ``version``, the ledger and held ids) and ``settings``."""
    check_batch(
        batch,
        vocab_size=settings.vocab_size,
        current_version=version,
        max_staleness=settings.cfg.max_staleness,
        seen=_Seen(ledger, held),
    )
    check_settings(batch, settings.cfg)


def check_settings(batch: Batch, cfg) -> None:
    """The trainer-only rule ``settings``: the batch was sampled as this trainer is configured."""
    want = {
        "mode": (cfg.rollout_logprobs_mode, "--rollout-logprobs-mode"),
        "k": (cfg.rollout_top_logprobs_num, "--rollout-top-logprobs-num"),
        "temperature": (cfg.rollout_temperature, "--rollout-temperature"),
        "top_p": (cfg.rollout_top_p, "--rollout-top-p"),
        "top_k": (cfg.rollout_top_k, "--rollout-top-k"),
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


class _Seen:
    """Trained ids plus those held for the current step: what rule 8 compares against."""

    def __init__(self, ledger: dict, held: dict):
        self.ledger, self.held = ledger, held

    def __contains__(self, batch_id) -> bool:
        return batch_id in self.ledger or batch_id in self.held


class Gate:
    """The NATS side of admission: pulls batches, holds, dead-letters and acks them."""

    def __init__(self, js, consumer, *, vocab_size: int, cfg, ledger: dict[str, list[int]]):
        self.js, self.consumer, self.cfg = js, consumer, cfg
        self.settings = GateSettings(vocab_size, cfg)
        self.ledger = ledger  # batch_id -> [stream sequence, step], saved in every checkpoint
        self.held: dict[str, Held] = {}
        self.counts: Counter = Counter()  # "accepted", "duplicate", "rejected:<rule>" since take_counts

    @property
    def held_samples(self) -> int:
        return sum(h.batch.num_samples for h in self.held.values())

    async def gather(
        self, target: int, version: int, timeout: float, stopping: asyncio.Event, min_samples: int = 1, starved=None
    ):
        """Hold accepted batches until they carry ``target`` samples, or ``timeout`` seconds
        passed with at least ``min_samples`` held; returns them in arrival order. Each
        ``timeout`` that passes with fewer than ``min_samples`` held, ``starved()`` is awaited
        (the trainer publishes one more step of tasks there)."""
        deadline = time.monotonic() + timeout
        while self.held_samples < target and not stopping.is_set():
            if time.monotonic() > deadline:
                if self.held_samples >= min_samples:
                    log.warning(
                        "step closes short after %.0fs: %d of %d samples arrived", timeout, self.held_samples, target
                    )
                    break
                log.warning(
                    "%d of %d samples after another %.0fs: are rollout workers running? (were tasks given up? "
                    "see the ADVISORIES stream)",
                    self.held_samples,
                    target,
                    timeout,
                )
                if starved is not None:
                    await starved()
                deadline = time.monotonic() + timeout
            want = max(1, math.ceil((target - self.held_samples) / max(1, self.cfg.rollout_n)))
            for msg in await self.consumer.fetch(want, timeout=1.0):
                await self.admit(msg, version)
        return list(self.held.values())

    async def admit(self, msg, version: int) -> None:
        """Hold ``msg``'s batch, or dead-letter it, or drop a redelivery of a trained one."""
        seq = msg.metadata.sequence.stream
        msg_id = (msg.headers or {}).get(names.MSG_ID_HEADER, "")
        verdict = admission(
            bytes(msg.data), seq, version, ledger=self.ledger, held=self.held, settings=self.settings, msg_id=msg_id
        )
        if verdict.action == HOLD:
            self.held[verdict.batch_id] = Held(msg, verdict.batch, seq)
            self.counts["accepted"] += 1
        elif verdict.action == DUPLICATE:  # trained and checkpointed, its ack was lost
            if await self.settle(msg, verdict.batch_id):
                self.counts["duplicate"] += 1
                log.info("redelivered batch %s (seq %d) was already trained; acked", verdict.batch_id, seq)
        elif verdict.action == REJECT:
            await self.reject(msg, seq, verdict.rule, verdict.reason, verdict.batch_id)
        # IGNORE: a redelivery of a message held right now; the held copy gets acked

    async def reject(self, msg, seq: int, rule: str, reason: str, batch_id: str) -> None:
        """Dead-letter the unchanged bytes, then ack (after the DLQ PubAck, so nothing is lost)."""
        headers = {
            "rule": rule,
            "reason": " ".join(reason.split())[:REASON_MAX],
            "batch_id": batch_id or "?",
            names.MSG_ID_HEADER: f"dlq/{seq}",
        }
        await publish_acked(self.js, names.DLQ_SUBJECT, bytes(msg.data), headers, what=f"dead letter of {batch_id!r}")
        faults.hit("trainer.rejected")
        if await self.settle(msg, batch_id):
            self.counts[f"rejected:{rule}"] += 1
            log.warning("batch %s dead-lettered (%s): %s", batch_id, rule, headers["reason"])

    async def settle(self, msg, batch_id: str) -> bool:
        """Ack a message the trainer is done with without training it; False if the ack is lost
        (NATS restarting): the message comes back and is dropped, or dead-lettered (the DLQ keeps
        one copy by Nats-Msg-Id), again."""
        try:
            await self.consumer.ack(msg)
            return True
        # every way an ack fails ends in the same redelivery
        except Exception as exc:  # noqa: BLE001
            log.warning("ack of batch %s failed (%s); it will be redelivered and settled again", batch_id, exc)
            return False

    async def commit(self, step: int) -> None:
        """The step, its checkpoint and ledger are durable: ack every held message."""
        self.ledger.update({bid: [h.seq, step] for bid, h in self.held.items()})
        held, self.held = list(self.held.values()), {}
        for h in held:
            try:
                await self.consumer.ack(h.msg)
            # a lost ack only means a redelivery, dropped by the ledger
            except Exception as exc:  # noqa: BLE001
                log.warning(
                    "ack of batch %s failed (%s); its redelivery will be dropped by the ledger", h.batch.batch_id, exc
                )

    async def release(self) -> None:
        """Abandon the current step: ask for redelivery of every held message, ack none."""
        for h in self.held.values():
            try:
                await self.consumer.nak(h.msg)
            # unacked messages come back after ack_wait anyway
            except Exception:  # noqa: BLE001
                pass
        self.held = {}

    async def keep_alive(self, interval: float) -> None:
        """Restart the ack_wait clock of every held message every ``interval`` seconds."""
        while True:
            await asyncio.sleep(interval)
            for h in list(self.held.values()):
                try:
                    await self.consumer.in_progress(h.msg)
                # the redelivery that follows is dropped by the gate
                except Exception as exc:  # noqa: BLE001
                    log.warning("in-progress ack for %s failed: %s", h.batch.batch_id, exc)

    def take_counts(self) -> Counter:
        counts, self.counts = self.counts, Counter()
        return counts


def concat_batches(batches: list[Batch], batch_id: str) -> Batch:
    """One global batch from accepted batches (same mode, K and sampling settings, which the
    gate enforces); offsets are rebased, ``extra["batch_ids"]`` lists the parts in order. It
    belongs to no task: ``task_id`` is ``batch_id``, one attempt, one part."""
    first = batches[0]
    arrays = {}
    for name in ARRAY_FIELDS:
        if name in ("offsets", "prompt_offsets"):
            continue
        arrays[name] = np.concatenate([getattr(b, name) for b in batches])
    for name, _per_token in (("offsets", "response_ids"), ("prompt_offsets", "prompt_ids")):
        lengths = np.concatenate([np.diff(getattr(b, name)) for b in batches])
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        arrays[name] = offsets
    return Batch(
        batch_id=batch_id,
        producer="trainer",
        task_id=batch_id,
        attempt=1,
        parts=1,
        weight_version=max(b.weight_version for b in batches),  # the newest token's, as in every batch
        mode=first.mode,
        k=first.k,
        temperature=first.temperature,
        top_p=first.top_p,
        top_k=first.top_k,
        sample_ids=[s for b in batches for s in b.sample_ids],
        group_ids=[g for b in batches for g in b.group_ids],
        extra={"batch_ids": [b.batch_id for b in batches]},
        **arrays,
    )

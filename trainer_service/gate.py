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


class _Seen:
    """Trained ids plus those held for the current step: what rule 8 compares against."""

    def __init__(self, ledger: dict, held: dict):
        self.ledger, self.held = ledger, held

    def __contains__(self, batch_id) -> bool:
        return batch_id in self.ledger or batch_id in self.held


class Gate:
    def __init__(self, js, consumer, *, vocab_size: int, cfg, ledger: dict[str, list[int]]):
        self.js, self.consumer, self.vocab_size, self.cfg = js, consumer, vocab_size, cfg
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
        try:
            batch = decode_batch(bytes(msg.data))
        except WireError as exc:
            await self.reject(msg, seq, "wire", str(exc), (msg.headers or {}).get(names.MSG_ID_HEADER, ""))
            return
        try:
            self.check(batch, version)
        except ContractViolation as exc:
            if exc.rule == "duplicate_batch" and self.is_redelivery(batch.batch_id, seq):
                # trained and checkpointed, its ack was lost
                if batch.batch_id in self.ledger and await self.settle(msg, batch.batch_id):
                    self.counts["duplicate"] += 1
                    log.info("redelivered batch %s (seq %d) was already trained; acked", batch.batch_id, seq)
                return  # else: a redelivery of a message held right now; the held copy gets acked
            await self.reject(msg, seq, exc.rule, str(exc), batch.batch_id)
            return
        self.held[batch.batch_id] = Held(msg, batch, seq)
        self.counts["accepted"] += 1

    def check(self, batch: Batch, version: int) -> None:
        """Raise ``ContractViolation`` unless ``batch`` may join the current step: the whole
        contract (staleness against ``version``, the ledger and held ids) and ``settings``.
        No I/O, so ``centerline replay --train`` gates recorded batches with it offline."""
        check_batch(
            batch,
            vocab_size=self.vocab_size,
            current_version=version,
            max_staleness=self.cfg.max_staleness,
            seen=_Seen(self.ledger, self.held),
        )
        self.check_settings(batch)

    def is_redelivery(self, batch_id: str, seq: int) -> bool:
        if batch_id in self.ledger:
            return self.ledger[batch_id][0] == seq
        return batch_id in self.held and self.held[batch_id].seq == seq

    def check_settings(self, batch: Batch) -> None:
        cfg = self.cfg
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

    def ledger_with_held(self, step: int) -> dict:
        """The ledger as it is once the current step is committed (what its checkpoint saves)."""
        return {**self.ledger, **{bid: [h.seq, step] for bid, h in self.held.items()}}

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
    gate enforces); offsets are rebased, ``extra["batch_ids"]`` lists the parts in order."""
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
        weight_version=min(b.weight_version for b in batches),
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

"""The gate's NATS side (docs/design.md section 10: exactly once per task group): rank 0 pulls
``rollouts.batches`` through the durable consumer ``names.TRAINER_CONSUMER``, asks
``admission.admission`` about each message, and acts on the answer and on the ledger:

- A rejected part is published to ``rollouts.dlq`` as the same bytes, with ``rule``, ``reason``
  and ``batch_id`` headers, then acked: it never blocks the stream. The DLQ message id is
  ``dlq/<stream sequence>``, so a redelivered reject is stored once. A part rejected as ``stale``
  has its task published again (``resample``) *before* it is dead-lettered and acked: a crash or a
  failed publish in between leaves the part unacked (a failed publish naks it), to come back and be
  published again; past ``max_republishes`` the part is dead-lettered as ``republish_cap``.
- An accepted part is *held* (unacked): *pending* while its attempt is incomplete, then in the step
  once the attempt is whole, until the step, its checkpoint and ledger are durable (``commit``);
  ``keep_alive`` marks it in progress every ``ack_wait / 3``.
- A redelivery of a trained part is acked, counted as ``duplicate``; a part of another attempt is
  acked, counted and logged as ``dropped:duplicate_attempt``, as are the pending parts of other
  attempts once a task is committed.
- A held-out batch goes to its round (``heldout.HeldoutRounds``), which keeps it unacked until
  its round is recorded, or it is dropped (acked) as ``heldout_late`` or ``heldout_duplicate``.
- An attempt still incomplete after the gate *waited* ``EXPIRE_ACK_WAITS * ack_wait`` seconds for
  its other parts (its worker died between two publishes) has its task published again, like a
  stale part's, then is dead-lettered part by part as ``incomplete_group``. The clock is the time
  spent fetching (``Gate.waited``): while the trainer trains it fetches nothing, and the other
  parts wait unfetched in the stream.
- A part larger than a message arrives in pieces (``trainer_service/pieces.py``): each is held unacked until
  every piece is there and the whole matches its digest, then the whole is admitted as one message
  (acked, nak'ed, kept alive and dead-lettered piece by piece). A piece whose part can never be whole
  is dead-lettered: ``piece_digest`` (corrupt, or two parts under one id), ``sample_too_large`` (above
  ``max_sample_bytes``), ``incomplete_sample`` (a piece still missing after the expiry above).
- A dead letter that JetStream does not store (the store full, NATS away) naks the part: it comes
  back and is dead-lettered then; the trainer never exits over it (``rejected_unstored``). Where the
  store is full (``StoreFull``) the nak waits ``ack_wait``, so that the part's deliveries last out the
  full store rather than run to ``max_deliver`` at once; so does a task not published again for it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter

import nats.errors

from shared import faults, names
from shared.nats_client import PublishError, StoreFull, publish_acked
from shared.pieces import OF_HEADER
from shared.wire import Batch, WireError, decode_batch
from trainer_service.admission import (
    DROP,
    DUPLICATE,
    DUPLICATE_ATTEMPT,
    EXPIRED_TASK,
    HELDOUT,
    HOLD,
    REJECT,
    GateSettings,
    admission,
    run_of,
)
from trainer_service.heldout import LATE, heldout_step
from trainer_service.ledger import GroupLedger, HeldPart
from trainer_service.pieces import Broken, Pieces, Whole
from trainer_service.tasks import times_republished

log = logging.getLogger("centerline.trainer.gate")
REASON_MAX = 1024  # header bytes kept of a rejection reason
# A live worker publishes an attempt's parts back to back (its publish retries take 3 x 10 s at
# most); one whose worker died is superseded by the task's redelivery within the workers' ack_wait.
EXPIRE_ACK_WAITS = 2
INCOMPLETE_GROUP, REPUBLISH_CAP = "incomplete_group", "republish_cap"


def max_ack_pending(
    prompts_per_step: int, rollout_n: int, inflight_steps: int, heldout_rows: int = 0, pieces: int = 1
) -> int:
    """The trainer consumer's ``max_ack_pending``, from the step's size (docs/design.md section 10): the
    parts it may hold unacked at once are one sample each at most, each in ``pieces`` messages at most
    (``shared.pieces.pieces_per_part``), for the step being gathered, the pending groups of the
    ``inflight_steps`` published ahead, each of them twice (an attempt published again beside a late
    one), and the held-out rows of a round being scored; never below 1,000."""
    step_parts = prompts_per_step * rollout_n * pieces
    return max(1000, 2 * (inflight_steps + 1) * step_parts + 2 * heldout_rows * pieces)


class Gate:
    """The NATS side of admission: pulls batches, holds, drops, dead-letters and acks them."""

    def __init__(
        self,
        js,
        consumer,
        *,
        vocab_size: int,
        cfg,
        ledger: dict[str, dict],
        first_task_step: int = 0,
        ack_wait: float = 30.0,
        resample=None,
        max_republishes: int = 0,
        heldout=None,
        run_id: str = "",
        clock=time.monotonic,
    ):
        """``resample(batch)``: awaited for a part rejected as stale or an attempt given up incomplete,
        publishes its task again (``trainer_service.tasks.TaskPublisher.resample``), True if it did;
        None publishes nothing. ``max_republishes``: how many times one task is published again at
        most (the trainer's). ``heldout``: the ``heldout.HeldoutRounds`` that held-out batches go to; None
        drops them as late. ``run_id``: this trainer's run (others' batches are ``foreign_run``).
        ``first_task_step``: the oldest task step whose tasks ``ledger`` keeps (``ledger.py``).
        ``clock``: seconds, the gate's fetch-time clock is measured with (a test's fake clock)."""
        self.js, self.consumer, self.cfg, self.resample, self.heldout = js, consumer, cfg, resample, heldout
        self.max_republishes, self.clock = max_republishes, clock
        self.given_up = 0  # groups given up at republish_cap since ``gather`` last took them off its target
        self.settings = GateSettings(vocab_size, cfg, run_id)
        self.groups = GroupLedger(ledger, first_task_step)
        self.pieces = Pieces(cfg.rollout.max_sample_bytes)  # parts larger than a message, being put together
        self.ack_wait, self.expire_after = ack_wait, EXPIRE_ACK_WAITS * ack_wait
        self.waited = 0.0  # seconds spent fetching: the clock an incomplete attempt expires by
        self.parked: list = []  # training batches fetched by finish_heldout: held unacked, given back at its end
        # "accepted", "duplicate", "dropped:<rule>", "rejected:<rule>", "resampled", "resample_failed",
        # "rejected_unstored"; the trainer's "store_full", "store_trimmed" (trainer_service/store.py) since take_counts
        self.counts: Counter = Counter()

    @property
    def ledger(self) -> dict[str, dict]:
        return self.groups.ledger

    @property
    def held(self) -> dict[str, HeldPart]:
        """The parts of the attempts held whole for the step, by batch_id."""
        return self.groups.held

    @property
    def held_samples(self) -> int:
        return sum(h.batch.num_samples for h in self.groups.held.values())

    async def fetch(self, count: int) -> list:
        """Up to ``count`` messages within a second; the time it took runs the expiry clock (``waited``)."""
        began = self.clock()
        msgs = await self.consumer.fetch(count, timeout=1.0)
        self.waited += max(0.0, self.clock() - began)
        return msgs

    async def gather(
        self, target: int, version: int, timeout: float, stopping: asyncio.Event, min_samples: int = 1, starved=None
    ):
        """Hold whole groups until they carry ``target`` samples, or ``timeout`` seconds
        passed with at least ``min_samples`` held; returns their parts in arrival order. Each
        ``timeout`` that passes with fewer than ``min_samples`` held, ``starved()`` is awaited
        (the trainer publishes one more step of tasks there). A group given up (``republish_cap``)
        never arrives: the step wants its samples less (no less than ``min_samples``), rather than
        wait out the timeout for it or publish a whole step of new tasks for one group."""
        deadline, full = time.monotonic() + timeout, target
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
            want = max(1, math.ceil((target - self.held_samples) / max(1, self.cfg.rollout.n)))
            for msg in await self.fetch(want):
                await self.admit(msg, version)
            await self.expire()
            if self.given_up:
                target = await self.short_of(target, full, min_samples, starved)
            await self.evaluated()
        return list(self.groups.held.values())

    async def short_of(self, target: int, full: int, min_samples: int, starved) -> int:
        """The step's target once ``given_up`` groups will never come: that many groups' samples less;
        where then nothing more is awaited and fewer than ``min_samples`` are held, ``starved()`` publishes
        the next step's tasks (the step wants ``full`` again)."""
        lost, self.given_up = self.given_up * self.cfg.rollout.n, 0
        target -= lost
        if target <= self.held_samples < min_samples and starved is not None:
            log.warning("task groups given up (republish_cap) and none held: the next step's tasks are published now")
            await starved()
            return full
        log.warning("%d samples' task groups given up (republish_cap): the step wants %d", lost, target)
        return max(target, min_samples)

    async def finish_heldout(self, stopping: asyncio.Event) -> None:
        """After the last step: take held-out batches until every open round is recorded or given up
        (``heldout_timeout``), or ``stopping`` is set. A training batch fetched meanwhile is parked: held
        unacked (kept alive) so that it is not delivered again and again while the rounds finish, then
        given back (nak) once: it costs one delivery, and the next trainer of the run trains it."""
        while self.heldout is not None and self.heldout.rounds and not stopping.is_set():
            for msg in await self.fetch(8):
                msg = await self.whole(msg)
                if msg is None:
                    continue
                try:
                    task_id = decode_batch(bytes(msg.data)).task_id
                except WireError:
                    task_id = ""
                if heldout_step(task_id) is not None or (
                    self.settings.run_id and run_of(task_id) != self.settings.run_id
                ):
                    await self.admit(msg, 0)  # a held-out batch's age is not checked; another run's is refused
                else:
                    self.parked.append(msg)
            await self.evaluated()
        parked, self.parked = self.parked, []
        for msg in parked:
            await self.give_back(msg)

    async def evaluated(self) -> None:
        """Ack the held-out parts whose rows are recorded (``heldout.HeldoutRounds.settled``); record each
        round with a result for every row, then ack its batches (a crash in between: they come back,
        and are dropped as late, the round being in ``heldout_metrics.jsonl``); give up the rounds past
        ``heldout_timeout``, acking what they held."""
        if self.heldout is None:
            return
        for h in self.heldout.take_settled():
            await self.settle(h.msg, h.batch.batch_id)
        now = time.monotonic()
        done, expired = self.heldout.finished(now)
        for r in done:
            self.heldout.record(self.heldout.figures(r, now))
            self.heldout.forget(r)
            for h in r.held:
                await self.settle(h.msg, h.batch.batch_id)
        for r in expired:
            log.warning(
                "held-out evaluation of step %d given up: %d of %d rows had a result after %gs (--heldout-timeout); "
                "no figure recorded for it",
                r.step,
                len(r.results),
                len(self.heldout.examples),
                self.heldout.timeout,
            )
            self.heldout.forget(r)
            for h in [*r.held, *(h for parts in r.attempts.values() for h in parts)]:
                await self.settle(h.msg, h.batch.batch_id)

    async def whole(self, msg):
        """``msg``, or where it is a piece: the ``Whole`` it completes, else None (held, or dead-lettered
        with the other pieces of its part). A piece of a part held whole is a redelivery: its held copy
        is acked with the part."""
        bid = (msg.headers or {}).get(OF_HEADER)
        if bid is not None and (bid in self.groups.held or any(bid in a.parts for a in self.groups.pending.values())):
            return None
        got = self.pieces.add(msg, self.waited)
        if isinstance(got, Broken):
            await self.broken(got)
            return None
        return got

    async def broken(self, b: Broken) -> None:
        """Dead-letter each piece of a part that can never be whole."""
        for m in b.msgs:
            await self.reject(m, m.metadata.sequence.stream, b.rule, b.reason, b.batch_id)

    async def admit(self, msg, version: int) -> None:
        """Hold ``msg``'s part, or dead-letter it, or drop a redelivery or another attempt of a trained task."""
        msg = await self.whole(msg)
        if msg is None:
            return
        seq = msg.metadata.sequence.stream
        msg_id = (msg.headers or {}).get(names.MSG_ID_HEADER, "")
        verdict = admission(bytes(msg.data), seq, version, groups=self.groups, settings=self.settings, msg_id=msg_id)
        if verdict.action == HOLD:
            self.groups.hold(HeldPart(msg, verdict.batch, seq), self.waited)
            self.counts["accepted"] += 1
        elif verdict.action == DUPLICATE:  # trained and checkpointed, its ack was lost
            if await self.settle(msg, verdict.batch_id):
                self.counts["duplicate"] += 1
                log.info("redelivered batch %s (seq %d) was already trained; acked", verdict.batch_id, seq)
        elif verdict.action == DROP:
            await self.drop(msg, verdict.batch_id, verdict.rule, verdict.reason)
        elif verdict.action == HELDOUT:
            rule = self.heldout.admit(HeldPart(msg, verdict.batch, seq)) if self.heldout is not None else LATE
            if rule:
                reason = (
                    f"held-out batch of task {verdict.batch.task_id!r}: its row has a result, or its round is closed"
                )
                await self.drop(msg, verdict.batch_id, rule, reason)
        elif verdict.action == REJECT and verdict.rule == "stale":
            await self.stale(msg, seq, verdict.batch, verdict.reason)
        elif verdict.action == REJECT:
            await self.reject(msg, seq, verdict.rule, verdict.reason, verdict.batch_id)
        # IGNORE: a redelivery of a message held right now; the held copy gets acked

    async def again(self, batch: Batch, rule: str) -> tuple[str, str | float | None]:
        """Publish the task of ``batch`` again (its part stale, or its attempt given up incomplete);
        ``(rule, why)`` to dead-letter the part under: ``rule``, or ``republish_cap`` past
        ``max_republishes``; ``("", delay)`` when the publish failed (the caller naks the parts after
        ``delay``, ``retry_delay``: they come back and the task is published then). Nothing when another
        attempt of the task is trained or held whole."""
        task = batch.task_id
        if self.resample is None or task in self.groups.ledger or task in self.groups.whole:
            return rule, ""
        times = times_republished(batch.attempt)
        if times >= self.max_republishes:
            self.given_up += 1
            why = (
                f"; task {task!r} was published again {times} times already (--max-republishes "
                f"{self.max_republishes}): it is not published again"
            )
            return REPUBLISH_CAP, why
        faults.hit("trainer.stale")
        try:
            if await self.resample(batch):
                self.counts["resampled"] += 1
        # the part stays unacked either way: it comes back and its task is published then
        except (PublishError, nats.errors.Error) as exc:
            log.warning("task %s not published again (%s); its %s part %s is nak'ed", task, exc, rule, batch.batch_id)
            self.counts["resample_failed"] += 1
            return "", self.retry_delay(exc)
        return rule, ""

    async def stale(self, msg, seq: int, batch: Batch, reason: str) -> None:
        """Publish the task of a stale part again, then dead-letter and ack the part (docs/design.md
        section 10; ``again``). A publish that fails naks the part: it comes back, and its task is
        published then."""
        rule, why = await self.again(batch, "stale")
        if not rule:
            await self.give_back(msg, why)
            return
        await self.reject(msg, seq, rule, reason + why, batch.batch_id)

    async def give_back(self, msg, delay: float | None = None) -> None:
        """Nak ``msg``: it is redelivered now rather than after ack_wait (after ``delay`` seconds if given)."""
        try:
            await (self.consumer.nak(msg) if delay is None else self.consumer.nak(msg, delay=delay))
        # unacked messages come back after ack_wait anyway
        except Exception:  # noqa: BLE001
            pass

    async def drop(self, msg, batch_id: str, rule: str, reason: str) -> None:
        """Ack a part that is not to be trained and is no defect (another attempt of a task trained)."""
        if await self.settle(msg, batch_id):
            self.counts[f"dropped:{rule}"] += 1
            log.info("batch %s dropped (%s): %s", batch_id, rule, reason)

    async def expire(self) -> None:
        """Give up the attempts incomplete after ``expire_after`` seconds of fetching (``waited``): publish
        their task again (``again``), then dead-letter their parts (``incomplete_group``)."""
        for b in self.pieces.expired(self.waited, self.expire_after):
            await self.broken(b)
        parts = self.groups.expired(self.waited, self.expire_after)
        attempts: dict[tuple[str, int], list[HeldPart]] = {}
        for h in parts:
            attempts.setdefault((h.batch.task_id, h.batch.attempt), []).append(h)
        for held in attempts.values():
            b = held[0].batch
            rule, why = await self.again(b, INCOMPLETE_GROUP)
            if not rule:  # not published again: the parts come back, form the attempt again, expire again
                for h in held:
                    await self.give_back(h.msg, why)
                continue
            reason = (
                f"attempt {b.attempt} of task {b.task_id!r} has {b.parts} parts and not all arrived while the gate "
                f"fetched for {self.expire_after:g}s ({EXPIRE_ACK_WAITS} x --ack-wait); a truncated group is never "
                f"trained (its worker died between two publishes and no other attempt of the task completed){why}"
            )
            for h in held:
                await self.reject(h.msg, h.seq, rule, reason, h.batch.batch_id)

    async def reject(self, msg, seq: int, rule: str, reason: str, batch_id: str) -> None:
        """Dead-letter the unchanged bytes, then ack (after the DLQ PubAck, so nothing is lost). A dead
        letter JetStream does not store (the DLQ at its byte cap, NATS away) naks the part instead,
        counted as ``rejected_unstored``: it comes back and is dead-lettered then. A ``Whole`` is
        dead-lettered piece by piece, each with its piece headers, so the DLQ can put it together again."""
        headers = {
            "rule": rule,
            "reason": " ".join(reason.split())[:REASON_MAX],
            "batch_id": batch_id or "?",
        }
        letters = msg.dead_letters() if isinstance(msg, Whole) else [(seq, msg, bytes(msg.data))]
        try:
            for at, m, data in letters:
                piece = {k: v for k, v in (m.headers or {}).items() if k.startswith("Centerline-Piece")}
                await publish_acked(
                    self.js,
                    names.DLQ_SUBJECT,
                    data,
                    {**headers, **piece, names.MSG_ID_HEADER: f"dlq/{at}"},
                    what=f"dead letter of {batch_id!r}",
                )
        except (PublishError, nats.errors.Error) as exc:
            delay = self.retry_delay(exc)
            log.warning(
                "batch %s (%s) not dead-lettered: %s; nak'ed, to be dead-lettered again%s",
                batch_id,
                rule,
                exc,
                f" in {delay:g}s" if delay else "",
            )
            self.counts["rejected_unstored"] += 1
            await self.give_back(msg, delay)
            return
        faults.hit("trainer.rejected")
        if await self.settle(msg, batch_id):
            self.counts[f"rejected:{rule}"] += 1
            log.warning("batch %s dead-lettered (%s): %s", batch_id, rule, headers["reason"])

    def retry_delay(self, exc: Exception) -> float | None:
        """Seconds before a part nak'ed after the failed publish ``exc`` comes back: ``ack_wait`` where the
        store was full (``StoreFull``: it frees slowly), else at once (None)."""
        return self.ack_wait if isinstance(exc, StoreFull) else None

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

    async def commit(self, step: int, first_task_step: int = 0) -> None:
        """The step, its checkpoint and ledger are durable: ack every held part, drop the pending
        parts of other attempts of the tasks it trained; the ledger forgets the tasks published
        before ``first_task_step`` and the pending parts of those are dead-lettered (``expired_task``)."""
        trained, superseded = self.groups.commit(step)
        for h in trained:
            try:
                await self.consumer.ack(h.msg)
            # a lost ack only means a redelivery, dropped by the ledger
            except Exception as exc:  # noqa: BLE001
                log.warning(
                    "ack of batch %s failed (%s); its redelivery will be dropped by the ledger", h.batch.batch_id, exc
                )
        for h in superseded:
            b = h.batch
            entry = self.groups.ledger[b.task_id]
            reason = (
                f"{b.batch_id!r} is part of incomplete attempt {b.attempt}; task {b.task_id!r} was trained from "
                f"attempt {entry['attempt']} at step {entry['step']}"
            )
            await self.drop(h.msg, b.batch_id, DUPLICATE_ATTEMPT, reason)
        for h in self.groups.forget_before(first_task_step):
            b = h.batch
            reason = (
                f"{b.batch_id!r} is a pending part of task {b.task_id!r}, older than task step {first_task_step}, "
                "the oldest the ledger keeps: never trained"
            )
            await self.reject(h.msg, h.seq, EXPIRED_TASK, reason, b.batch_id)

    async def release(self) -> None:
        """Abandon the current step: ask for redelivery of every held and pending part, ack none."""
        for h in [*self.groups.release(), *(self.heldout.parts() if self.heldout is not None else [])]:
            await self.give_back(h.msg)
        for m in self.pieces.release():
            await self.give_back(m)

    async def keep_alive(self, interval: float) -> None:
        """Restart the ack_wait clock of every held and pending part every ``interval`` seconds."""
        while True:
            await asyncio.sleep(interval)
            heldout = self.heldout.parts() if self.heldout is not None else []
            parked = [HeldPart(m, None, 0) for m in [*self.parked, *self.pieces.messages()]]
            for h in [*self.groups.every_part(), *heldout, *parked]:
                try:
                    await self.consumer.in_progress(h.msg)
                # the redelivery that follows is dropped by the gate
                except Exception as exc:  # noqa: BLE001
                    log.warning("in-progress ack for %s failed: %s", h.batch.batch_id if h.batch else "a batch", exc)

    def take_counts(self) -> Counter:
        counts, self.counts = self.counts, Counter()
        return counts

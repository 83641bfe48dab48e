"""The trainer's gate, without servers: fake messages, consumer and JetStream record what it does."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from centerline.synth import make_batch
from rollout_worker.packing import batch_id_of
from rollout_worker.publish import select_samples
from shared import names
from shared.config import Config
from shared.wire import decode_batch, encode_batch
from trainer_service.admission import DROP, DUPLICATE, HOLD, IGNORE, REJECT, GateSettings, admission
from trainer_service.gate import Gate
from trainer_service.ledger import GroupLedger, HeldPart
from trainer_service.tasks import attempts_base

VOCAB, K = 64, 8
CFG = Config(rollout_top_logprobs_num=K, rollout_n=4, max_staleness=1)


class Msg:
    def __init__(self, data: bytes, seq: int):
        self.data, self.headers = data, {}
        self.metadata = SimpleNamespace(sequence=SimpleNamespace(stream=seq))


class Recorder:
    """Stands in for the consumer (acks) and JetStream (DLQ publishes)."""

    def __init__(self):
        self.acked, self.published, self.naked, self.delays = [], [], [], []

    async def ack(self, msg):
        self.acked.append(msg)

    async def nak(self, msg, delay=None):
        self.naked.append(msg)
        self.delays.append(delay)

    async def publish(self, subject, data, headers=None, timeout=None):
        self.published.append((subject, data, headers))


class LosingAcks(Recorder):
    """Every ack is lost, as while the NATS server restarts."""

    async def ack(self, msg):
        raise TimeoutError("nats: timeout")


def gate(ledger=None, rec=None, **kw) -> tuple[Gate, Recorder]:
    rec = rec or Recorder()
    return Gate(rec, rec, vocab_size=VOCAB, cfg=CFG, ledger=dict(ledger or {}), **kw), rec


def trained(task="b-0", attempt=1, step=2, **parts):
    """A ledger of one trained task; ``parts``: batch_id -> stream sequence (default: the task id at 7)."""
    return {task: {"attempt": attempt, "step": step, "parts": parts or {task: 7}}}


def batch(batch_id="b-0", version=3, **kw):
    return make_batch(
        samples=4, tokens_per_sample=3, k=K, vocab_size=VOCAB, batch_id=batch_id, weight_version=version, **kw
    )


def admit(g: Gate, msg: Msg, version: int = 3) -> None:
    asyncio.run(g.admit(msg, version))


def test_valid_batch_is_held_unacked():
    g, rec = gate()
    admit(g, Msg(encode_batch(batch()), seq=7))
    assert list(g.held) == ["b-0"] and g.held["b-0"].seq == 7
    assert rec.acked == [] and rec.published == []
    assert g.take_counts() == {"accepted": 1}


def test_redelivery_of_a_trained_message_is_acked_silently():
    g, rec = gate(ledger=trained())
    msg = Msg(encode_batch(batch()), seq=7)
    admit(g, msg)
    assert rec.acked == [msg] and rec.published == [] and g.held == {}
    assert g.take_counts() == {"duplicate": 1}


def test_a_lost_ack_of_a_trained_redelivery_leaves_it_to_come_back_uncounted():
    g, rec = gate(ledger=trained(), rec=LosingAcks())
    admit(g, Msg(encode_batch(batch()), seq=7))  # raises nothing: the next redelivery is dropped the same way
    assert rec.published == [] and g.held == {} and g.take_counts() == {}


def test_another_message_with_a_trained_batch_id_is_dead_lettered():
    g, rec = gate(ledger=trained())
    data = encode_batch(batch())
    msg = Msg(data, seq=9)
    admit(g, msg)
    [(subject, sent, headers)] = rec.published
    assert (subject, sent) == (names.DLQ_SUBJECT, data)
    assert headers["rule"] == "duplicate_batch" and headers["batch_id"] == "b-0"
    assert headers[names.MSG_ID_HEADER] == "dlq/9"
    assert rec.acked == [msg]


def test_redelivery_of_a_held_message_is_neither_acked_nor_held_twice():
    g, rec = gate()
    data = encode_batch(batch())
    admit(g, Msg(data, seq=7))
    admit(g, Msg(data, seq=7))
    assert len(g.held) == 1 and rec.acked == [] and rec.published == []


def test_same_batch_id_twice_in_one_step_keeps_the_first():
    g, rec = gate()
    data = encode_batch(batch())
    admit(g, Msg(data, seq=7))
    admit(g, Msg(data, seq=8))
    assert g.held["b-0"].seq == 7
    assert [h["rule"] for _, _, h in rec.published] == ["duplicate_batch"]


@pytest.mark.parametrize(
    ("make", "rule"),
    [
        (lambda: batch(version=1), "stale"),
        (lambda: batch(version=4), "unknown_version"),
        (lambda: replace(batch(), advantages=np.array([0, np.nan, 0, 0], np.float32)), "non_finite"),
        (lambda: batch(mode="support", top_k=4), "settings"),
    ],
)
def test_rejected_batch_goes_to_the_dlq_unchanged_with_its_rule(make, rule):
    g, rec = gate()
    data = encode_batch(make())
    admit(g, Msg(data, seq=3))
    [(_, sent, headers)] = rec.published
    assert sent == data and headers["rule"] == rule and headers["reason"]
    assert len(rec.acked) == 1 and g.held == {}
    assert g.take_counts() == {f"rejected:{rule}": 1}


def test_a_lost_ack_after_the_dead_letter_leaves_the_batch_to_come_back_uncounted():
    g, rec = gate(rec=LosingAcks())
    data = encode_batch(batch(version=1))
    admit(g, Msg(data, seq=3))  # raises nothing: dead-lettered again on redelivery, the DLQ keeps one copy by dlq/3
    [(_, sent, headers)] = rec.published
    assert (sent, headers["rule"], headers[names.MSG_ID_HEADER]) == (data, "stale", "dlq/3")
    assert g.held == {} and g.take_counts() == {}


def test_undecodable_bytes_are_dead_lettered_as_wire():
    g, rec = gate()
    admit(g, Msg(b"\x81\xa1v\x02", seq=5))
    [(_, sent, headers)] = rec.published
    assert sent == b"\x81\xa1v\x02" and headers["rule"] == "wire"


def test_commit_records_the_ledger_and_acks_every_held_message():
    g, rec = gate()
    msgs = [Msg(encode_batch(batch(f"b-{i}")), seq=10 + i) for i in range(2)]
    for m in msgs:
        admit(g, m)
    assert g.ledger == {}  # not before the checkpoint is durable
    asyncio.run(g.commit(step=5))
    assert g.ledger == {
        "b-0": {"attempt": 1, "step": 5, "parts": {"b-0": 10}},
        "b-1": {"attempt": 1, "step": 5, "parts": {"b-1": 11}},
    }
    assert rec.acked == msgs and g.held == {}


def test_keep_alive_marks_every_held_message_in_progress():
    g, rec = gate()
    marked = []

    async def in_progress(msg):
        marked.append(msg)

    rec.in_progress = in_progress
    msgs = [Msg(encode_batch(batch(f"b-{i}")), seq=i + 1) for i in range(2)]

    async def run():
        for m in msgs:
            await g.admit(m, 3)
        task = asyncio.create_task(g.keep_alive(0.01))
        while len(marked) < 4:  # two rounds
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(asyncio.wait_for(run(), 10))
    assert marked[:4] == msgs + msgs


SETTINGS = GateSettings(VOCAB, CFG)


def test_admission_is_decided_without_io_from_message_ledger_held_and_settings():
    data = encode_batch(batch("b-0"))
    assert admission(data, 7, 3, groups=GroupLedger({}), settings=SETTINGS).action == HOLD
    # the trained message again (a lost ack), or a copy recorded from the subject (no sequence)
    for seq in (7, 0):
        assert admission(data, seq, 3, groups=GroupLedger(trained(step=1)), settings=SETTINGS).action == DUPLICATE
    groups = GroupLedger({})
    groups.hold(HeldPart(None, batch("b-0"), 7), now=0.0)
    assert admission(data, 7, 3, groups=groups, settings=SETTINGS).action == IGNORE
    other = admission(data, 8, 3, groups=GroupLedger(trained(step=1)), settings=SETTINGS)
    assert (other.action, other.rule) == (REJECT, "duplicate_batch")
    wire = admission(b"\x81\xa1v\x02", 9, 3, groups=GroupLedger({}), settings=SETTINGS, msg_id="m-9")
    assert (wire.action, wire.rule, wire.batch_id, wire.batch) == (REJECT, "wire", "m-9", None)


# ---------------------------------------------------------------- exactly once per task group


def attempt_parts(attempt: int, task="T", seed=0) -> list[bytes]:
    """Attempt ``attempt`` of task ``task``: 4 samples in 2 parts of 2 (batch ids T/0-2, T/2-4, or
    T#2/0-2, T#2/2-4 for attempt 2), as the worker publishes them."""
    whole = replace(batch(task if attempt == 1 else f"{task}#{attempt}", seed=seed), task_id=task, attempt=attempt)
    bid = whole.batch_id
    # what rollout_worker.publish.split_batch makes of it under a limit that holds two samples
    return [
        encode_batch(replace(select_samples(whole, slice(a, b)), batch_id=f"{bid}/{a}-{b}", parts=2))
        for a, b in ((0, 2), (2, 4))
    ]


def test_a_split_group_is_held_for_the_step_only_once_every_part_of_its_attempt_arrived():
    g, rec = gate()
    first, second = attempt_parts(1)
    admit(g, Msg(first, seq=1))
    assert g.held == {} and g.held_samples == 0  # pending: a truncated group is never trained
    assert list(g.groups.pending) == [("T", 1)]
    admit(g, Msg(second, seq=2))
    assert list(g.held) == ["T/0-2", "T/2-4"] and g.held_samples == 4 and g.groups.pending == {}
    asyncio.run(g.commit(step=0))
    assert g.ledger == {"T": {"attempt": 1, "step": 0, "parts": {"T/0-2": 1, "T/2-4": 2}}}
    assert [m.metadata.sequence.stream for m in rec.acked] == [1, 2]
    assert g.take_counts() == {"accepted": 2}


def test_a_partial_attempt_is_dropped_as_duplicate_attempt_once_another_attempt_of_its_task_is_trained():
    """The worker died between the two publishes of attempt 1; the redelivered task's attempt 2
    arrives whole and is trained; attempt 1's part is acked, counted and never trained."""
    g, rec = gate()
    a1 = attempt_parts(1)
    a2 = attempt_parts(2, seed=1)
    admit(g, Msg(a1[0], seq=1))
    admit(g, Msg(a2[0], seq=2))
    admit(g, Msg(a2[1], seq=3))
    assert list(g.held) == ["T#2/0-2", "T#2/2-4"] and list(g.groups.pending) == [("T", 1)]
    asyncio.run(g.commit(step=4))
    assert g.ledger == {"T": {"attempt": 2, "step": 4, "parts": {"T#2/0-2": 2, "T#2/2-4": 3}}}
    assert [m.metadata.sequence.stream for m in rec.acked] == [2, 3, 1] and rec.published == []
    assert g.groups.pending == {} and g.held == {}
    assert g.take_counts() == {"accepted": 3, "dropped:duplicate_attempt": 1}
    # attempt 1's last part, published late (or redelivered), is dropped the same way
    late = Msg(a1[1], seq=9)
    admit(g, late)
    assert rec.acked[-1] is late and rec.published == [] and g.take_counts() == {"dropped:duplicate_attempt": 1}


def test_another_attempt_of_a_task_held_whole_is_dropped_at_once():
    g, rec = gate()
    for seq, data in enumerate(attempt_parts(1), 1):
        admit(g, Msg(data, seq=seq))
    again = Msg(attempt_parts(2, seed=1)[0], seq=3)
    admit(g, again)
    assert rec.acked == [again] and list(g.held) == ["T/0-2", "T/2-4"] and g.groups.pending == {}
    assert g.take_counts() == {"accepted": 2, "dropped:duplicate_attempt": 1}


def test_another_attempt_of_a_trained_task_is_dropped_not_dead_lettered_even_when_stale():
    resampled = []

    async def resample(b):
        resampled.append(b.batch_id)
        return True

    g, rec = gate(ledger=trained("T", step=0, **{"T": 1}), resample=resample)
    msg = Msg(encode_batch(replace(batch("T#2", version=0), task_id="T", attempt=2)), seq=5)
    admit(g, msg)
    assert rec.acked == [msg] and rec.published == [] and resampled == []
    assert g.take_counts() == {"dropped:duplicate_attempt": 1}
    verdict = admission(bytes(msg.data), 5, 3, groups=g.groups, settings=SETTINGS)
    assert (verdict.action, verdict.rule) == (DROP, "duplicate_attempt")
    assert verdict.reason == "'T#2' is of attempt 2; task 'T' was trained from attempt 1 at step 0"


def test_an_attempt_whose_parts_never_all_arrive_is_dead_lettered_as_incomplete_group_after_two_ack_waits():
    g, rec = gate(ack_wait=3.0)
    first = Msg(attempt_parts(1)[0], seq=4)
    admit(g, first)
    asyncio.run(g.expire())
    assert rec.published == [] and g.held == {}  # not yet: 6 s have not passed
    g.waited += 6.5  # the gate fetched for 6.5 s since
    asyncio.run(g.expire())
    [(subject, sent, headers)] = rec.published
    assert (subject, sent, headers["rule"], headers["batch_id"]) == (
        names.DLQ_SUBJECT,
        first.data,
        "incomplete_group",
        "T/0-2",
    )
    assert "not all arrived while the gate fetched for 6s (2 x --ack-wait)" in headers["reason"]
    assert rec.acked == [first] and g.groups.pending == {}
    assert g.take_counts() == {"accepted": 1, "rejected:incomplete_group": 1}


def test_groups_expire_only_attempts_older_than_the_limit():
    groups = GroupLedger({})
    a = decode_batch(attempt_parts(1)[0])
    c = decode_batch(attempt_parts(2, seed=1)[0])
    groups.hold(HeldPart("m1", a, 1), now=10.0)
    groups.hold(HeldPart("m3", c, 3), now=15.0)
    assert [h.msg for h in groups.expired(now=16.0, after=6.0)] == []  # 6 s after m1 is not past the limit
    assert [h.msg for h in groups.expired(now=16.5, after=6.0)] == ["m1"]
    assert list(groups.pending) == [("T", 2)]


def test_a_stale_part_has_its_task_published_again_unless_another_attempt_is_held_or_trained():
    resampled = []

    async def resample(b):
        resampled.append((b.task_id, b.attempt))
        return True

    g, rec = gate(resample=resample, max_republishes=3)
    stale = replace(batch("U", version=1), task_id="U")
    admit(g, Msg(encode_batch(stale), seq=1))
    assert resampled == [("U", 1)] and [h["rule"] for _, _, h in rec.published] == ["stale"]
    assert g.take_counts() == {"rejected:stale": 1, "resampled": 1}
    for seq, data in enumerate(attempt_parts(1), 2):
        admit(g, Msg(data, seq=seq))
    admit(g, Msg(encode_batch(replace(batch("T#3", version=1), task_id="T", attempt=3, parts=1)), seq=5))
    assert resampled == [("U", 1)]  # T is held whole: dropped as another attempt, nothing sampled again


def test_parts_of_one_attempt_that_disagree_on_the_part_count_are_rejected_as_shape():
    g, rec = gate()
    first, second = attempt_parts(1)
    admit(g, Msg(first, seq=1))
    odd = replace(decode_batch(second), parts=3)
    admit(g, Msg(encode_batch(odd), seq=2))
    [(_, _, headers)] = rec.published
    assert headers["rule"] == "shape" and "has 3 parts" in headers["reason"] and "says 2" in headers["reason"]


def test_release_naks_held_and_pending_parts_and_keep_alive_covers_both():
    g, rec = gate()
    marked = []

    async def in_progress(msg):
        marked.append(msg)

    rec.in_progress = in_progress
    whole = Msg(encode_batch(batch("b-0")), seq=1)
    part = Msg(attempt_parts(1)[0], seq=2)

    async def run():
        for m in (whole, part):
            await g.admit(m, 3)
        task = asyncio.create_task(g.keep_alive(0.01))
        while len(marked) < 2:
            await asyncio.sleep(0.01)
        task.cancel()
        await g.release()

    asyncio.run(asyncio.wait_for(run(), 10))
    assert marked[:2] == [whole, part] and rec.naked == [whole, part]
    assert g.held == {} and g.groups.pending == {} and rec.acked == []


# ---------------------------------------------------------------- one attempt, one split


def sampling(attempt: int, cuts: tuple[int, ...], task="T", seed=0) -> list[bytes]:
    """One sampling of attempt ``attempt`` of ``task``: 4 samples named as the worker names them
    (``f"{task}/{i}"``), split after the samples ``cuts`` as rollout_worker.publish.split_batch does."""
    whole = replace(
        batch(batch_id_of(task, attempt), seed=seed),
        task_id=task,
        attempt=attempt,
        sample_ids=[f"{task}/{i}" for i in range(4)],
    )
    bounds = list(zip((0, *cuts), (*cuts, 4)))
    return [
        encode_batch(
            replace(select_samples(whole, slice(a, b)), batch_id=f"{whole.batch_id}/{a}-{b}", parts=len(bounds))
        )
        for a, b in bounds
    ]


# Two samplings that carry one attempt number (a stale task published again while its first message
# was redelivered, before attempt numbers were reserved per publication), split at different samples.
COPIES = {"A": sampling(1, (2,)), "B": sampling(1, (1,), seed=1)}


def samples_held(g: Gate, task: str) -> int:
    return sum(h.batch.num_samples for h in g.groups.every_part() if h.batch.task_id == task)


@pytest.mark.parametrize(
    "order",
    list(itertools.permutations([(copy, i) for copy in COPIES for i in range(2)])),
    ids=lambda order: "-".join(f"{copy}{i}" for copy, i in order),
)
def test_two_samplings_of_one_attempt_split_differently_train_one_group_in_every_order(order):
    g, rec = gate()
    for seq, (copy, i) in enumerate(order, 1):
        admit(g, Msg(COPIES[copy][i], seq=seq))
        assert samples_held(g, "T") <= CFG.rollout.n
    winner = order[0][0]  # the sampling whose part came first
    seqs = {(copy, i): seq for seq, (copy, i) in enumerate(order, 1)}
    ids = {copy: [decode_batch(data).batch_id for data in parts] for copy, parts in COPIES.items()}
    assert sorted(g.held) == ids[winner] and g.held_samples == 4 and g.groups.pending == {}
    losers = [ids[copy][i] for copy, i in order if copy != winner]
    assert [(h["batch_id"], h["rule"]) for _, _, h in rec.published] == [(bid, "split_conflict") for bid in losers]
    assert len(rec.acked) == 2  # the dead letters, acked
    asyncio.run(g.commit(step=0))
    assert g.ledger == {"T": {"attempt": 1, "step": 0, "parts": {ids[winner][i]: seqs[(winner, i)] for i in range(2)}}}
    assert g.take_counts() == {"accepted": 2, "rejected:split_conflict": 2}


def test_a_split_part_that_would_complete_its_attempt_short_of_n_samples_is_a_split_conflict():
    first, _ = sampling(1, (2,))
    _, late = sampling(1, (3,), seed=1)  # samples 3 to 4 of another split: with 0 to 2, 3 of 4 samples in 2 parts
    groups = GroupLedger({})
    groups.hold(HeldPart(None, decode_batch(first), 1), now=0.0)
    verdict = admission(late, 2, 3, groups=groups, settings=SETTINGS)
    assert (verdict.action, verdict.rule) == (REJECT, "split_conflict")
    assert verdict.reason == (
        "'T/3-4' (attempt 1 of task 'T', 1 samples) would complete the 2 parts of the attempt with 3 of its "
        "--rollout-n 4 samples, with its parts ['T/0-2']: two splits of the attempt"
    )


def test_a_stale_part_of_a_task_published_again_max_republishes_times_is_dead_lettered_as_republish_cap():
    resampled = []

    async def resample(b):
        resampled.append(b.attempt)
        return True

    g, rec = gate(resample=resample, max_republishes=2)
    below = attempts_base(7, 1) + 1  # published again once: once more
    at = attempts_base(8, 2) + 3  # published again twice: not again
    for seq, attempt in enumerate((below, at), 1):
        admit(g, Msg(encode_batch(replace(batch(f"T#{attempt}", version=1), task_id="T", attempt=attempt)), seq=seq))
    assert resampled == [below] == [71001]
    assert [h["rule"] for _, _, h in rec.published] == ["stale", "republish_cap"]
    assert rec.published[1][2]["reason"].endswith(
        "task 'T' was published again 2 times already (--max-republishes 2): it is not published again"
    )
    assert len(rec.acked) == 2 and g.take_counts() == {"rejected:stale": 1, "resampled": 1, "rejected:republish_cap": 1}


class Feeding(Recorder):
    """A consumer whose ``fetch`` hands out ``queue``."""

    def __init__(self, queue: list[Msg]):
        super().__init__()
        self.queue = queue

    async def fetch(self, n, timeout=None):
        if not self.queue:  # as the server's fetch: nothing there, the caller waits its timeout
            await asyncio.sleep(timeout or 0)
        out, self.queue = self.queue[:n], self.queue[n:]
        return out


def test_a_group_given_up_at_the_republish_cap_has_new_tasks_published_at_once_not_after_the_timeout():
    at = attempts_base(8, 2) + 3  # published again twice: not again
    feed = Feeding([Msg(encode_batch(replace(batch(f"T#{at}", version=1), task_id="T", attempt=at)), seq=1)])
    published = []

    async def starved():  # the trainer publishes the next step's tasks; one of them comes back sampled
        published.append("next step")
        feed.queue.append(Msg(encode_batch(batch("U")), seq=2))

    async def resample(b):
        return True

    g = Gate(feed, feed, vocab_size=VOCAB, cfg=CFG, ledger={}, resample=resample, max_republishes=2)
    gathering = g.gather(CFG.rollout.n, 3, timeout=600.0, stopping=asyncio.Event(), starved=starved)
    held = asyncio.run(asyncio.wait_for(gathering, timeout=30))  # the step timeout is 600 s
    assert published == ["next step"] and [h.batch.batch_id for h in held] == ["U"]
    assert [h["rule"] for _, _, h in feed.published] == ["republish_cap"] and g.given_up == 0

"""The gate at real sizes and speeds, without servers (issue 38): expiry by the time the gate fetched,
incomplete groups published again, a given-up group that does not publish a whole step, another
run's batches refused by name, a dead letter JetStream does not store, held-out rows acked as they
are written, training batches parked while the held-out rounds finish, the consumer's limits."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import nats.errors
import orjson
from nats.js.errors import APIError

from shared.nats_client import PullConsumer
from shared.wire import encode_batch
from tests.trainer_service.test_gate import CFG, VOCAB, Msg, Recorder, attempt_parts, batch
from tests.trainer_service.test_heldout import ROWS, heldout_batch
from trainer_service.admission import REJECT, GateSettings, admission
from trainer_service.gate import Gate, max_ack_pending
from trainer_service.heldout import HeldoutRounds
from trainer_service.ledger import GroupLedger
from trainer_service.tasks import Example, attempts_base


class Clock:
    """A fake ``time.monotonic`` that a test advances."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Scripted(Recorder):
    """A consumer whose fetches hand out a script of ``(seconds the fetch takes, messages)``, then nothing."""

    def __init__(self, clock: Clock, script: list[tuple[float, list[Msg]]]):
        super().__init__()
        self.clock, self.script, self.fetches = clock, list(script), 0

    async def fetch(self, n, timeout=None):
        self.fetches += 1
        took, msgs = self.script.pop(0) if self.script else (timeout or 1.0, [])
        self.clock.now += took
        return msgs


def test_a_split_group_whose_step_waits_61s_between_its_parts_is_trained_not_dead_lettered():
    clock = Clock()
    part1, part2 = attempt_parts(1)
    feed = Scripted(clock, [(0.01, [Msg(part1, seq=1)])])
    g = Gate(feed, feed, vocab_size=VOCAB, cfg=CFG, ledger={}, ack_wait=30.0, clock=clock)
    for msg in asyncio.run(g.fetch(2)):
        asyncio.run(g.admit(msg, 3))
    clock.now += 61.0  # the trainer trains, checkpoints and loads weights: it fetches nothing
    # the next step's first fetch finds nothing yet (a second of waiting), the second finds part 2
    feed.script = [(1.0, []), (0.01, [Msg(part2, seq=2)])]
    held = asyncio.run(asyncio.wait_for(g.gather(4, 3, timeout=600.0, stopping=asyncio.Event()), 30))
    assert [h.batch.batch_id for h in held] == ["T/0-2", "T/2-4"] and feed.published == []
    assert round(g.waited, 2) == 1.02  # the expiry clock: what the gate waited while fetching
    assert g.take_counts() == {"accepted": 2}


def test_an_incomplete_group_has_its_task_published_again_capped_and_counted_like_a_stale_one():
    resampled = []

    async def resample(b):
        resampled.append((b.task_id, b.attempt))
        return True

    rec = Recorder()
    g = Gate(rec, rec, vocab_size=VOCAB, cfg=CFG, ledger={}, ack_wait=3.0, resample=resample, max_republishes=1)
    first = Msg(attempt_parts(1)[0], seq=4)
    asyncio.run(g.admit(first, 3))
    g.waited += 6.5
    asyncio.run(g.expire())
    assert resampled == [("T", 1)] and [h["rule"] for _, _, h in rec.published] == ["incomplete_group"]
    assert rec.acked == [first] and g.given_up == 0
    assert g.take_counts() == {"accepted": 1, "resampled": 1, "rejected:incomplete_group": 1}
    # published again once already (--max-republishes 1): given up, named republish_cap
    at = attempts_base(3, 1) + 1
    whole = replace(batch(f"T#{at}"), task_id="T", attempt=at, parts=2)
    again = Msg(encode_batch(replace(whole, batch_id=f"T#{at}/0-2")), seq=9)
    asyncio.run(g.admit(again, 3))
    g.waited += 6.5
    asyncio.run(g.expire())
    assert resampled == [("T", 1)] and rec.published[-1][2]["rule"] == "republish_cap" and g.given_up == 1
    assert "published again 1 times already (--max-republishes 1)" in rec.published[-1][2]["reason"]


class Feed(Recorder):
    def __init__(self, queue):
        super().__init__()
        self.queue = queue

    async def fetch(self, n, timeout=None):
        if not self.queue:
            await asyncio.sleep(timeout or 0)
        out, self.queue = self.queue[:n], self.queue[n:]
        return out


def test_a_group_given_up_at_the_republish_cap_shrinks_its_step_and_publishes_no_step_of_new_tasks():
    at = attempts_base(8, 2) + 3  # published again twice: not again
    capped = Msg(encode_batch(replace(batch(f"T#{at}", version=1), task_id="T", attempt=at)), seq=1)
    other = Msg(encode_batch(batch("U")), seq=2)
    feed = Feed([capped, other])
    published = []

    async def starved():
        published.append("next step")

    async def resample(b):
        return True

    g = Gate(feed, feed, vocab_size=VOCAB, cfg=CFG, ledger={}, resample=resample, max_republishes=2)
    gathering = g.gather(2 * CFG.rollout.n, 3, timeout=600.0, stopping=asyncio.Event(), starved=starved)
    held = asyncio.run(asyncio.wait_for(gathering, timeout=30))  # the step timeout is 600 s
    assert published == [] and [h.batch.batch_id for h in held] == ["U"]
    assert [h["rule"] for _, _, h in feed.published] == ["republish_cap"]


def test_a_batch_of_another_run_is_refused_by_name_before_anything_holds_it():
    rec = Recorder()
    g = Gate(rec, rec, vocab_size=VOCAB, cfg=CFG, ledger={}, run_id="run2")
    theirs = Msg(encode_batch(replace(batch("run1/0/0"), task_id="run1/0/0")), seq=3)
    their_heldout = Msg(encode_batch(heldout_batch(0, 0, 1.0)), seq=4)  # task r1/heldout/0/0
    ours = Msg(encode_batch(replace(batch("run2/0/0"), task_id="run2/0/0")), seq=5)
    for msg in (theirs, their_heldout, ours):
        asyncio.run(g.admit(msg, 3))
    assert list(g.held) == ["run2/0/0"] and rec.acked == [theirs, their_heldout]
    assert [(h["rule"], h["batch_id"]) for _, _, h in rec.published] == [
        ("foreign_run", "run1/0/0"),
        ("foreign_run", "r1/heldout/0/0/a1"),
    ]
    assert "of run 'run1'; this trainer runs 'run2'" in rec.published[0][2]["reason"]
    # replay (no run id) judges every run's batches
    assert (
        admission(bytes(theirs.data), 3, 3, groups=GroupLedger({}), settings=GateSettings(VOCAB, CFG)).action == "hold"
    )


def test_a_whole_batch_must_hold_rollout_n_distinct_samples():
    short = replace(batch("T"), task_id="T")
    three = encode_batch(replace(short, sample_ids=["a", "b", "c", "c"]))
    verdict = admission(three, 3, 3, groups=GroupLedger({}), settings=GateSettings(VOCAB, CFG))
    assert (verdict.action, verdict.rule) == (REJECT, "group_size")
    assert verdict.reason == (
        "'T' is the whole group of attempt 1 of task 'T' with 4 samples, 3 of them distinct; "
        "a group is --rollout-n 4 distinct samples"
    )


class FullStore(Recorder):
    """JetStream refuses every publish: the server's store is used up (its answer, as
    tests/reliability/test_full_store.py gets it from a real nats-server)."""

    async def publish(self, subject, data, headers=None, timeout=None):
        raise APIError(code=503, err_code=10023, description="insufficient resources")


def test_a_dead_letter_the_store_refuses_naks_the_part_after_ack_wait_and_the_trainer_goes_on():
    rec = FullStore()
    g = Gate(rec, rec, vocab_size=VOCAB, cfg=CFG, ledger={}, run_id="r2", ack_wait=7.0)
    msg = Msg(encode_batch(replace(batch("r9/0/0"), task_id="r9/0/0")), seq=3)
    asyncio.run(g.admit(msg, 3))
    # back after ack_wait, not at once: its deliveries last out the full store
    assert rec.naked == [msg] and rec.delays == [7.0] and rec.acked == [] and g.held == {}
    assert g.take_counts() == {"rejected_unstored": 1}


class Unreachable(Recorder):
    async def publish(self, subject, data, headers=None, timeout=None):
        raise nats.errors.TimeoutError


def test_a_dead_letter_nats_does_not_answer_naks_the_part_at_once():
    rec = Unreachable()
    g = Gate(rec, rec, vocab_size=VOCAB, cfg=CFG, ledger={}, run_id="r2", ack_wait=7.0)
    msg = Msg(encode_batch(replace(batch("r9/0/0"), task_id="r9/0/0")), seq=3)
    asyncio.run(g.admit(msg, 3))
    assert rec.naked == [msg] and rec.delays == [None] and g.take_counts() == {"rejected_unstored": 1}


def heldout_rounds(tmp_path, recorded, rows):
    return HeldoutRounds(
        rows, run_id="r1", attempts_before=0, every=2, timeout=60.0, record=recorded.append, rows_dir=tmp_path
    )


def test_a_heldout_set_of_2000_rows_completes_its_round_each_row_acked_once_written(tmp_path):
    rows = [Example(f"q{i}=", "a", "exact", {}) for i in range(2000)]
    recorded = []
    heldout = heldout_rounds(tmp_path, recorded, rows)
    rec = Recorder()
    g = Gate(rec, rec, vocab_size=VOCAB, cfg=CFG, ledger={}, heldout=heldout, run_id="r1")
    asyncio.run(heldout.schedule(rec, 0, version=0))
    msgs = [Msg(encode_batch(heldout_batch(0, row, float(row % 2))), seq=row + 1) for row in range(2000)]
    for msg in msgs[:1000]:
        asyncio.run(g.admit(msg, 0))
    asyncio.run(g.evaluated())
    assert rec.acked == msgs[:1000] and recorded == []  # acked as written: never 1,000 unacked at once
    assert len((tmp_path / "0.jsonl").read_bytes().splitlines()) == 1000
    # the trainer restarts: the rows written count, the rest come
    heldout2 = heldout_rounds(tmp_path, recorded, rows)
    g2 = Gate(rec, rec, vocab_size=VOCAB, cfg=CFG, ledger={}, heldout=heldout2, run_id="r1")
    asyncio.run(heldout2.schedule(rec, 0, version=0))
    for msg in msgs[1000:]:
        asyncio.run(g2.admit(msg, 0))
    asyncio.run(g2.evaluated())
    [record] = recorded
    assert (record["step"], record["heldout_rows"], record["heldout_accuracy"]) == (0, 2000, 0.5)
    assert rec.acked == msgs and not (tmp_path / "0.jsonl").exists()


def test_finish_heldout_parks_training_batches_and_gives_each_back_once(tmp_path):
    recorded = []
    heldout = HeldoutRounds(ROWS[:1], run_id="r1", attempts_before=0, every=2, timeout=60.0, record=recorded.append)
    train = Msg(encode_batch(replace(batch("r1/5/0"), task_id="r1/5/0")), seq=1)
    row = Msg(encode_batch(heldout_batch(3, 0, 1.0)), seq=2)
    feed = Feed([train, row])
    g = Gate(feed, feed, vocab_size=VOCAB, cfg=CFG, ledger={}, heldout=heldout, run_id="r1")
    asyncio.run(heldout.schedule(feed, 3, version=3))
    asyncio.run(asyncio.wait_for(g.finish_heldout(asyncio.Event()), 30))
    assert [r["step"] for r in recorded] == [3] and feed.acked == [row]
    assert feed.naked == [train] and g.parked == []  # one delivery spent, not max_deliver of them


def test_max_ack_pending_follows_the_step_size_and_the_heldout_rows():
    assert max_ack_pending(8, 4, 2) == 1000  # small steps: nats' default stays
    assert max_ack_pending(64, 16, 2, heldout_rows=2000) == 2 * 3 * 64 * 16 + 2 * 2000
    # samples in 3 pieces each (shared.pieces.pieces_per_part): every piece is a message held unacked
    assert max_ack_pending(64, 16, 2, heldout_rows=2000, pieces=3) == 3 * (2 * 3 * 64 * 16 + 2 * 2000)


def test_a_fetch_asks_for_no_more_messages_than_the_clients_buffer_holds_at_max_payload():
    asked = []

    async def fetch(n, timeout):
        asked.append(n)
        return []

    sub = SimpleNamespace(_sub=SimpleNamespace(_pending_bytes_limit=256 << 20), fetch=fetch)
    consumer = PullConsumer(sub, max_payload=8 << 20)
    asyncio.run(consumer.fetch(100, timeout=0.1))
    asyncio.run(consumer.fetch(5, timeout=0.1))
    assert asked == [32, 5]


def test_rows_written_before_a_crash_are_read_back_and_a_line_cut_short_is_left_out(tmp_path):
    (tmp_path / "2.jsonl").write_bytes(
        orjson.dumps({"task_id": "r1/heldout/2/0", "reward": 1.0, "version": 2}) + b'\n{"task_id": "r1/held'
    )
    heldout = heldout_rounds(tmp_path, [], ROWS)
    asyncio.run(heldout.schedule(Recorder(), 2, version=2))
    assert heldout.rounds[2].results == {"r1/heldout/2/0": (1.0, 2)}

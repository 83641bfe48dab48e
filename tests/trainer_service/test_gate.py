"""The trainer's gate, without servers: fake messages, consumer and JetStream record what it does."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from shared import names
from shared.config import Config
from shared.contract import check_batch
from shared.synth import make_batch
from shared.wire import encode_batch, replace_arrays
from trainer_service.gate import (
    DUPLICATE,
    HOLD,
    IGNORE,
    REJECT,
    Gate,
    GateSettings,
    Held,
    admission,
    concat_batches,
)

VOCAB, K = 64, 8
CFG = Config(rollout_top_logprobs_num=K, rollout_n=4, max_staleness=1)


class Msg:
    def __init__(self, data: bytes, seq: int):
        self.data, self.headers = data, {}
        self.metadata = SimpleNamespace(sequence=SimpleNamespace(stream=seq))


class Recorder:
    """Stands in for the consumer (acks) and JetStream (DLQ publishes)."""

    def __init__(self):
        self.acked, self.published = [], []

    async def ack(self, msg):
        self.acked.append(msg)

    async def publish(self, subject, data, headers=None, timeout=None):
        self.published.append((subject, data, headers))


class LosingAcks(Recorder):
    """Every ack is lost, as while the NATS server restarts."""

    async def ack(self, msg):
        raise TimeoutError("nats: timeout")


def gate(ledger=None, rec=None) -> tuple[Gate, Recorder]:
    rec = rec or Recorder()
    return Gate(rec, rec, vocab_size=VOCAB, cfg=CFG, ledger=dict(ledger or {})), rec


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
    g, rec = gate(ledger={"b-0": [7, 2]})
    msg = Msg(encode_batch(batch()), seq=7)
    admit(g, msg)
    assert rec.acked == [msg] and rec.published == [] and g.held == {}
    assert g.take_counts() == {"duplicate": 1}


def test_a_lost_ack_of_a_trained_redelivery_leaves_it_to_come_back_uncounted():
    g, rec = gate(ledger={"b-0": [7, 2]}, rec=LosingAcks())
    admit(g, Msg(encode_batch(batch()), seq=7))  # raises nothing: the next redelivery is dropped the same way
    assert rec.published == [] and g.held == {} and g.take_counts() == {}


def test_another_message_with_a_trained_batch_id_is_dead_lettered():
    g, rec = gate(ledger={"b-0": [7, 2]})
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
        (lambda: replace_arrays(batch(), advantages=np.array([0, np.nan, 0, 0], np.float32)), "non_finite"),
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
    assert g.ledger == {"b-0": [10, 5], "b-1": [11, 5]} and rec.acked == msgs and g.held == {}


def test_concat_batches_is_one_valid_global_batch():
    parts = [
        batch("a", seed=1),
        make_batch(samples=2, tokens_per_sample=5, k=K, vocab_size=VOCAB, batch_id="b", seed=2, prompt_len=2),
    ]
    whole = concat_batches(parts, batch_id="step-0")
    check_batch(whole, vocab_size=VOCAB)
    assert whole.num_samples == 6 and whole.num_tokens == 4 * 3 + 2 * 5
    assert whole.offsets.tolist() == [0, 3, 6, 9, 12, 17, 22]
    assert whole.prompt_offsets.tolist() == [0, 3, 6, 9, 12, 14, 16]
    assert whole.extra["batch_ids"] == ["a", "b"]
    for i, (part, j) in enumerate([(parts[0], j) for j in range(4)] + [(parts[1], j) for j in range(2)]):
        assert np.array_equal(whole.cand_ids[whole.sample_slice(i)], part.cand_ids[part.sample_slice(j)])
        assert np.array_equal(
            whole.prompt_ids[whole.prompt_offsets[i] : whole.prompt_offsets[i + 1]],
            part.prompt_ids[part.prompt_offsets[j] : part.prompt_offsets[j + 1]],
        )


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
    assert admission(data, 7, 3, ledger={}, held={}, settings=SETTINGS).action == HOLD
    # the trained message again (a lost ack), or a copy recorded from the subject (no sequence)
    for seq in (7, 0):
        assert admission(data, seq, 3, ledger={"b-0": [7, 1]}, held={}, settings=SETTINGS).action == DUPLICATE
    held = {"b-0": Held(None, batch("b-0"), 7)}
    assert admission(data, 7, 3, ledger={}, held=held, settings=SETTINGS).action == IGNORE
    other = admission(data, 8, 3, ledger={"b-0": [7, 1]}, held={}, settings=SETTINGS)
    assert (other.action, other.rule) == (REJECT, "duplicate_batch")
    wire = admission(b"\x81\xa1v\x02", 9, 3, ledger={}, held={}, settings=SETTINGS, msg_id="m-9")
    assert (wire.action, wire.rule, wire.batch_id, wire.batch) == (REJECT, "wire", "m-9", None)

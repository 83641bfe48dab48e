"""A sample larger than ``max_payload`` against a real nats-server (docs/design.md section 3): the
worker's ``publish_batch`` sends it in pieces, the gate puts them together, the contract checks the
whole and the step trains it once, every piece acked at the commit; a piece that never arrives or
arrives corrupted dead-letters its part by name, never trained, never redelivered."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from centerline.nats_server import EmbeddedNats
from centerline.synth import make_batch
from rollout_worker.publish import publish_batch, split_batch
from shared import names, pieces
from shared.config import Config
from shared.nats_client import connect, pull_consumer
from shared.streams import ensure_streams
from shared.wire import decode_batch
from tests.processes import stored_messages
from trainer_service.gate import Gate

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # rows of the fault table (docs/operations.md)

VOCAB, K, N = 64, 8, 4
CFG = Config(rollout_top_logprobs_num=K, rollout_n=N, max_staleness=1)
MAX_PAYLOAD = 64 << 10  # each sample below (1,200 tokens of 13 + 8K bytes) is about 1.5 messages


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Waiting:
    """The trainer's consumer, each fetch of which lasts ``clock.wait`` seconds on the gate's clock."""

    def __init__(self, consumer, clock: Clock):
        self.consumer, self.clock, self.wait = consumer, clock, 0.0

    async def fetch(self, count: int, timeout: float = 1.0) -> list:
        msgs = await self.consumer.fetch(count, timeout=timeout)
        self.clock.now += self.wait
        return msgs

    def __getattr__(self, name):
        return getattr(self.consumer, name)


def long_group(task: str, seed: int = 0):
    whole = make_batch(samples=N, tokens_per_sample=1200, k=K, vocab_size=VOCAB, seed=seed, weight_version=3)
    return replace(whole, batch_id=task, task_id=task, sample_ids=[f"{task}/{i}" for i in range(N)])


async def gate_of(js, clock=None) -> Gate:
    consumer = await pull_consumer(
        js, names.ROLLOUTS_STREAM, names.TRAINER_CONSUMER, filter_subject=names.ROLLOUTS_SUBJECT, ack_wait=30.0
    )
    if clock is None:
        return Gate(js, consumer, vocab_size=VOCAB, cfg=CFG, ledger={}, ack_wait=30.0)
    return Gate(js, Waiting(consumer, clock), vocab_size=VOCAB, cfg=CFG, ledger={}, ack_wait=30.0, clock=clock)


def test_a_sample_over_max_payload_travels_in_pieces_and_is_trained_whole_once(tmp_path):
    batch = long_group("r1/0/0")

    async def main():
        with EmbeddedNats(tmp_path / "nats", max_payload=MAX_PAYLOAD) as server:
            nc = await connect(server.url)
            js = nc.jetstream()
            await ensure_streams(js)
            acks = await publish_batch(js, batch, max_payload=nc.max_payload)
            again = await publish_batch(js, batch, max_payload=nc.max_payload)  # a worker's retry: deduplicated
            gate = await gate_of(js)
            held = await gate.gather(N, 3, timeout=60.0, stopping=asyncio.Event())
            await gate.commit(0)
            info = await js.consumer_info(names.ROLLOUTS_STREAM, names.TRAINER_CONSUMER)
            stored = await stored_messages(server.url, names.ROLLOUTS_STREAM)
            dead = (await js.stream_info(names.DLQ_STREAM)).state.messages
            await nc.close()
            return acks, again, held, gate.ledger, gate.take_counts(), info, stored, dead

    acks, again, held, ledger, counts, info, stored, dead = asyncio.run(main())
    assert len(acks) == 8 and [a.duplicate for a in again] == [True] * 8  # 4 one-sample parts, 2 pieces each
    assert max(len(m.data) for m in stored) <= MAX_PAYLOAD and len(stored) == 8
    assert {m.headers[pieces.PIECE_HEADER] for m in stored} == {"0/2", "1/2"}
    parts = split_batch(batch, MAX_PAYLOAD)  # what the worker meant: each part as one
    assert [(h.batch.batch_id, h.batch.sample_ids) for h in held] == [
        (p.batch_id, decode_batch(p.data).sample_ids) for p in parts
    ]
    assert [bytes(h.msg.data) for h in held] == [p.data for p in parts]
    assert [h.seq for h in held] == [1, 3, 5, 7]  # each part's first piece
    assert ledger == {
        "r1/0/0": {"attempt": 1, "step": 0, "parts": {p.batch_id: 1 + 2 * i for i, p in enumerate(parts)}}
    }
    assert counts == {"accepted": 4}
    assert (info.num_ack_pending, info.num_pending, dead) == (0, 0, 0)  # every piece acked once, nothing refused


def test_a_part_short_of_a_piece_or_with_a_corrupt_one_is_dead_lettered_by_name_never_trained(tmp_path):
    batch = long_group("r1/0/0")
    parts = split_batch(batch, MAX_PAYLOAD)
    limit = MAX_PAYLOAD - pieces.HEADER_ROOM

    async def main():
        with EmbeddedNats(tmp_path / "nats", max_payload=MAX_PAYLOAD) as server:
            nc = await connect(server.url)
            js = nc.jetstream()
            await ensure_streams(js)
            for i, part in enumerate(parts):
                cut = pieces.cut(part.data, part.batch_id, limit)
                if i == 1:  # its worker died before the second piece
                    cut = cut[:1]
                if i == 2:  # a bit flipped on the way
                    mid, data, headers = cut[1]
                    cut[1] = (mid, bytes([data[0] ^ 1]) + data[1:], headers)
                for _, data, headers in cut:
                    await js.publish(names.ROLLOUTS_SUBJECT, data, headers=headers)
            clock = Clock()
            gate = await gate_of(js, clock)
            for _ in range(3):
                for msg in await gate.fetch(16):
                    await gate.admit(msg, 3)
            gate.consumer.wait = 61.0  # the gate waits past 2 x ack_wait for the missing piece and parts
            assert await gate.fetch(1) == []
            await gate.expire()
            info = await js.consumer_info(names.ROLLOUTS_STREAM, names.TRAINER_CONSUMER)
            letters = await stored_messages(server.url, names.DLQ_STREAM)
            await nc.close()
            return gate.held, gate.take_counts(), info, letters

    held, counts, info, letters = asyncio.run(main())
    assert held == {}
    by_rule = sorted((m.headers["rule"], m.headers["batch_id"], m.headers.get(pieces.PIECE_HEADER)) for m in letters)
    assert by_rule == [
        ("incomplete_group", "r1/0/0/0-1", "0/2"),
        ("incomplete_group", "r1/0/0/0-1", "1/2"),
        ("incomplete_group", "r1/0/0/3-4", "0/2"),
        ("incomplete_group", "r1/0/0/3-4", "1/2"),
        ("incomplete_sample", "r1/0/0/1-2", "0/2"),
        ("piece_digest", "r1/0/0/2-3", "0/2"),
        ("piece_digest", "r1/0/0/2-3", "1/2"),
    ]
    assert counts == {
        "accepted": 2,
        "rejected:incomplete_group": 2,
        "rejected:incomplete_sample": 1,
        "rejected:piece_digest": 2,
    }
    assert (info.num_ack_pending, info.num_pending) == (0, 0)

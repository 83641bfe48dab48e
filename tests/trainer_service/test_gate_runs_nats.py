"""The gate against a real nats-server at the sizes of issue 38: a 90 s step cycle with split groups
(the time a busy trainer does not fetch, on a fake clock) loses nothing; two runs one after the other
on one NATS: the second trains none of the first's tasks; the streams' byte caps come from the
trainer's settings and a worker's streams call never undoes them."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from centerline.nats_server import EmbeddedNats
from centerline.synth import make_batch
from rollout_worker.publish import select_samples
from shared import names
from shared.config import Config
from shared.nats_client import connect, pull_consumer
from shared.settings import TrainerSettings
from shared.streams import StreamLimits, ensure_streams
from shared.wire import encode_batch
from tests.processes import stored_messages
from trainer_service.gate import Gate

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # rows of the fault table (docs/operations.md)

VOCAB, K, N = 64, 8, 4
CFG = Config(rollout_top_logprobs_num=K, rollout_n=N, max_staleness=1)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def group(task: str, split: bool, seed: int = 0) -> list[tuple[str, bytes]]:
    """A worker's sampling of ``task``: one message, or two parts of two samples."""
    whole = make_batch(samples=N, tokens_per_sample=3, k=K, vocab_size=VOCAB, seed=seed, weight_version=3)
    whole = replace(whole, batch_id=task, task_id=task, sample_ids=[f"{task}/{i}" for i in range(N)])
    if not split:
        return [(task, encode_batch(whole))]
    return [
        (
            f"{task}/{a}-{b}",
            encode_batch(replace(select_samples(whole, slice(a, b)), batch_id=f"{task}/{a}-{b}", parts=2)),
        )
        for a, b in ((0, 2), (2, 4))
    ]


async def publish(js, sampling) -> None:
    for bid, data in sampling:
        await js.publish(names.ROLLOUTS_SUBJECT, data, headers={names.MSG_ID_HEADER: bid})


async def gate_of(js, run_id: str, clock=None) -> Gate:
    consumer = await pull_consumer(
        js, names.ROLLOUTS_STREAM, names.TRAINER_CONSUMER, filter_subject=names.ROLLOUTS_SUBJECT, ack_wait=30.0
    )
    kw = {"clock": clock} if clock is not None else {}
    return Gate(js, consumer, vocab_size=VOCAB, cfg=CFG, ledger={}, ack_wait=30.0, run_id=run_id, **kw)


def test_a_90s_step_cycle_with_split_groups_loses_none(tmp_path):
    async def main():
        with EmbeddedNats(tmp_path / "nats") as server:
            nc = await connect(server.url)
            js = nc.jetstream()
            await ensure_streams(js)
            clock = Clock()
            gate = await gate_of(js, "r1", clock)
            trained = []
            for step in range(3):
                # each step: two groups split in two parts; the second part of one lands while the trainer trains
                await publish(js, group(f"r1/{step}/0", split=True, seed=step))
                first, second = group(f"r1/{step}/1", split=True, seed=10 + step)
                await publish(js, [first])
                held = await gate.gather(N, 3, timeout=120.0, stopping=asyncio.Event())
                trained += [h.batch.batch_id for h in held]
                await gate.commit(step)
                clock.now += 90.0  # the step cycle: training, checkpoint, weights; nothing fetched
                await publish(js, [second])
            for step in range(3, 9):  # the groups left came whole after their step: one gather each
                if len(gate.ledger) == 6:
                    break
                held = await gate.gather(N, 3, timeout=120.0, stopping=asyncio.Event())
                trained += [h.batch.batch_id for h in held]
                await gate.commit(step)
            info = await js.stream_info(names.DLQ_STREAM)
            await nc.close()
            return trained, info.state.messages, gate.ledger

    trained, dead, ledger = asyncio.run(main())
    assert dead == 0  # nothing dead-lettered as incomplete_group
    assert sorted(ledger) == sorted([f"r1/{s}/{j}" for s in range(3) for j in (0, 1)])
    assert len(trained) == len(set(trained)) == 12  # 6 groups of 2 parts, each trained once


def test_two_runs_one_after_the_other_on_one_nats_the_second_trains_none_of_the_firsts(tmp_path):
    async def main():
        with EmbeddedNats(tmp_path / "nats") as server:
            nc = await connect(server.url)
            js = nc.jetstream()
            await ensure_streams(js)
            # run 1 stops with two of its groups sampled and never trained (a redeploy, a new experiment)
            await publish(js, group("run1/7/0", split=False) + group("run1/7/1", split=True, seed=1))
            gate = await gate_of(js, "run2")
            await publish(js, group("run2/0/0", split=False, seed=2) + group("run2/0/1", split=True, seed=3))
            held = await gate.gather(2 * N, 3, timeout=60.0, stopping=asyncio.Event())
            await gate.commit(0)
            info = await js.consumer_info(names.ROLLOUTS_STREAM, names.TRAINER_CONSUMER)
            letters = await stored_messages(server.url, names.DLQ_STREAM)
            await nc.close()
            return held, gate.ledger, gate.take_counts(), info, letters

    held, ledger, counts, info, letters = asyncio.run(main())
    assert sorted(ledger) == ["run2/0/0", "run2/0/1"]
    assert sorted(h.batch.task_id for h in held) == ["run2/0/0", "run2/0/1", "run2/0/1"]
    assert counts == {"accepted": 3, "rejected:foreign_run": 3}
    assert (info.num_ack_pending, info.num_pending) == (0, 0)
    assert sorted(m.headers["batch_id"] for m in letters) == ["run1/7/0", "run1/7/1/0-2", "run1/7/1/2-4"]
    assert {m.headers["rule"] for m in letters} == {"foreign_run"}


def test_stream_byte_caps_come_from_the_settings_and_a_workers_call_keeps_them(tmp_path):
    settings = TrainerSettings(prompts_per_step=2, store_retention_steps=3)
    rollouts, dlq = settings.store_caps(CFG)
    per_sample = CFG.rollout.session_max_tokens * (13 + 8 * K) + 4096
    assert (rollouts, dlq) == (3 * 2 * N * per_sample, 2 * N * per_sample)

    async def main():
        with EmbeddedNats(tmp_path / "nats") as server:
            nc = await connect(server.url)
            js = nc.jetstream()
            await ensure_streams(js, StreamLimits(rollouts_max_bytes=rollouts, dlq_max_bytes=dlq))
            again = await ensure_streams(js)  # a worker, the proxy: no caps of their own
            caps = [(await js.stream_info(s)).config.max_bytes for s in (names.ROLLOUTS_STREAM, names.DLQ_STREAM)]
            await nc.close()
            return again, caps

    again, caps = asyncio.run(main())
    assert set(again.values()) == {"unchanged"} and caps == [rollouts, dlq]

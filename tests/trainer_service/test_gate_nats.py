"""The gate's stale path and one sampling per attempt number against a real nats-server: a stale
part's task is published again before the part is acked, so neither a failed publish nor a
trainer killed on the way loses the group or stores it twice; a trainer restarted before its
first checkpoint, past the duplicate window, trains each group once (docs/design.md section 10).

A killed trainer is a gate whose connection closes with nothing acked, at the place ``Killed`` is
raised: the server redelivers its unacked parts after ``ACK_WAIT``, to the next trainer's gate.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, replace

import orjson
import pytest

from centerline.nats_server import EmbeddedNats
from centerline.synth import make_batch
from rollout_worker.packing import batch_id_of
from rollout_worker.publish import select_samples
from shared import faults, names
from shared.config import Config
from shared.nats_client import PublishError, connect, pull_consumer
from shared.streams import StreamLimits, ensure_streams
from shared.task import PromptTask
from shared.wire import encode_batch
from tests.processes import stored_messages
from trainer_service.gate import Gate
from trainer_service.tasks import AttemptBlocks, TaskPublisher, attempts_base, load_dataset

pytestmark = pytest.mark.integration

VOCAB, K, N = 64, 8, 4
CFG = Config(rollout_top_logprobs_num=K, rollout_n=N, max_staleness=1)
ACK_WAIT = 1.0  # seconds before a killed trainer's unacked parts come back
TASK = "r1/0/0"


class Killed(BaseException):
    """The trainer process dying where this is raised."""


@pytest.fixture
def nats(tmp_path):
    with EmbeddedNats(tmp_path / "nats") as server:
        yield server


@pytest.fixture
def dataset(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_bytes(orjson.dumps({"prompt": "2+2=", "answer": "4", "reward": "exact_match"}) + b"\n")
    return path


@dataclass
class Trainer:
    """What one start of the trainer runs of the gate: its consumer of batches, task publisher and gate."""

    nc: object
    js: object
    tasks: TaskPublisher
    gate: Gate


@contextlib.asynccontextmanager
async def trainer(url: str, dataset, limits: StreamLimits | None = None):
    nc = await connect(url)
    js = nc.jetstream()
    await ensure_streams(js, limits or StreamLimits())
    consumer = await pull_consumer(
        js, names.ROLLOUTS_STREAM, names.TRAINER_CONSUMER, filter_subject=names.ROLLOUTS_SUBJECT, ack_wait=ACK_WAIT
    )
    blocks = AttemptBlocks(dataset.with_name("attempt_blocks"))  # the run directory's: no checkpoint in these runs
    tasks = TaskPublisher(load_dataset(dataset), run_id="r1", seed=0, prompts_per_step=1, n=N, blocks=blocks)
    gate = Gate(
        js,
        consumer,
        vocab_size=VOCAB,
        cfg=CFG,
        ledger={},
        ack_wait=ACK_WAIT,
        resample=lambda batch: tasks.resample(js, batch),
        max_republishes=3,
    )
    try:
        yield Trainer(nc, js, tasks, gate)
    finally:
        await nc.close()  # a killed trainer's unacked messages come back after ACK_WAIT


def parts(attempt: int, cuts: tuple[int, ...], version: int, seed: int = 0) -> list[tuple[str, bytes]]:
    """A worker's sampling of attempt ``attempt`` of ``TASK``, split after the samples ``cuts``: (batch id, bytes)."""
    whole = make_batch(samples=N, tokens_per_sample=3, k=K, vocab_size=VOCAB, seed=seed, weight_version=version)
    whole = replace(
        whole,
        batch_id=batch_id_of(TASK, attempt),
        task_id=TASK,
        attempt=attempt,
        sample_ids=[f"{TASK}/{i}" for i in range(N)],
    )
    if not cuts:
        return [(whole.batch_id, encode_batch(whole))]
    bounds = list(zip((0, *cuts), (*cuts, N)))
    out = []
    for a, b in bounds:
        part = replace(select_samples(whole, slice(a, b)), batch_id=f"{whole.batch_id}/{a}-{b}", parts=len(bounds))
        out.append((part.batch_id, encode_batch(part)))
    return out


async def publish(js, sampling: list[tuple[str, bytes]]) -> None:
    for bid, data in sampling:
        await js.publish(names.ROLLOUTS_SUBJECT, data, headers={names.MSG_ID_HEADER: bid})


async def one(t: Trainer, what: str):
    """The next batch the trainer's consumer delivers, waiting at most a redelivery's time for it."""
    msgs = await t.gate.consumer.fetch(1, timeout=ACK_WAIT + 10)
    assert len(msgs) == 1, f"no {what} within {ACK_WAIT + 10} s"
    return msgs[0]


async def settled(url: str) -> tuple[list[PromptTask], list[dict], tuple[int, int]]:
    """The tasks PROMPTS holds, the DLQ's headers, and the trainer consumer's (unacked, undelivered) counts."""
    prompts = [PromptTask.from_bytes(m.data) for m in await stored_messages(url, names.PROMPTS_STREAM)]
    letters = [m.headers for m in await stored_messages(url, names.DLQ_STREAM)]
    nc = await connect(url)
    try:
        info = await nc.jetstream().consumer_info(names.ROLLOUTS_STREAM, names.TRAINER_CONSUMER)
    finally:
        await nc.close()
    return prompts, letters, (info.num_ack_pending, info.num_pending)


def test_a_stale_part_whose_task_cannot_be_published_again_comes_back_and_is_published_then(nats, dataset):
    async def body():
        async with trainer(nats.url, dataset) as t:
            await publish(t.js, parts(1, (), version=1))  # 2 versions behind the trainer's 3
            sample_again = t.gate.resample

            async def unreachable(batch):
                raise PublishError(f"no PubAck for task {batch.task_id!r} again: is the NATS server reachable?")

            t.gate.resample = unreachable
            await t.gate.admit(await one(t, "stale part"), 3)
            assert await settled(nats.url) == ([], [], (1, 0))  # not dead-lettered, not acked: nak'ed
            again = await one(t, "nak'ed stale part")
            assert again.metadata.num_delivered == 2
            t.gate.resample = sample_again
            await t.gate.admit(again, 3)
            assert t.gate.take_counts() == {"resample_failed": 1, "resampled": 1, "rejected:stale": 1}
        prompts, letters, pending = await settled(nats.url)
        # block 0 is the trainer's own, block 1 the task's again: published again once, attempts 11001 on
        assert [(p.task_id, p.attempts_before) for p in prompts] == [(TASK, attempts_base(1, 1))]
        assert [(h["rule"], h["batch_id"]) for h in letters] == [("stale", TASK)] and pending == (0, 0)

    asyncio.run(asyncio.wait_for(body(), 60))


def test_a_trainer_killed_while_publishing_a_stale_parts_task_again_publishes_it_after_its_restart(nats, dataset):
    async def body():
        async with trainer(nats.url, dataset) as t:
            await publish(t.js, parts(1, (), version=1))

            async def dies(batch):
                raise Killed

            t.gate.resample = dies
            with pytest.raises(Killed):
                await t.gate.admit(await one(t, "stale part"), 3)
        assert await settled(nats.url) == ([], [], (1, 0))
        async with trainer(nats.url, dataset) as restarted:
            await restarted.gate.admit(await one(restarted, "the killed trainer's stale part"), 3)
            assert restarted.gate.take_counts() == {"resampled": 1, "rejected:stale": 1}
        prompts, letters, pending = await settled(nats.url)
        # blocks 0 and 1: the two starts'; 2: the task's again
        assert [(p.task_id, p.attempts_before) for p in prompts] == [(TASK, attempts_base(2, 1))]
        assert [(h["rule"], h["batch_id"]) for h in letters] == [("stale", TASK)] and pending == (0, 0)

    asyncio.run(asyncio.wait_for(body(), 60))


def test_a_trainer_killed_after_publishing_a_stale_parts_task_again_leaves_one_copy_of_it(nats, dataset, monkeypatch):
    def killed_once(name, step=None):
        if name == "trainer.rejected":
            monkeypatch.setattr(faults, "hit", hit)
            raise Killed

    hit = faults.hit
    monkeypatch.setattr(faults, "hit", killed_once)

    async def body():
        async with trainer(nats.url, dataset) as t:
            await publish(t.js, parts(1, (), version=1))
            with pytest.raises(Killed):  # at the failpoint trainer.rejected: published again, dead-lettered, not acked
                await t.gate.admit(await one(t, "stale part"), 3)
        async with trainer(nats.url, dataset) as restarted:
            await restarted.gate.admit(await one(restarted, "the killed trainer's stale part"), 3)
            # JetStream holds the task again under its Nats-Msg-Id already: not stored, nor counted, twice
            assert restarted.gate.take_counts() == {"rejected:stale": 1}
        prompts, letters, pending = await settled(nats.url)
        assert [(p.task_id, p.attempts_before) for p in prompts] == [(TASK, attempts_base(1, 1))]
        assert [(h["rule"], h["batch_id"]) for h in letters] == [("stale", TASK)] and pending == (0, 0)

    asyncio.run(asyncio.wait_for(body(), 60))


def test_a_trainer_restarted_before_its_first_checkpoint_past_the_duplicate_window_trains_each_group_once(
    nats, dataset
):
    """The first trainer's task is sampled and split at sample 2; the trainer dies before any
    checkpoint; the next start publishes the task again once the duplicate window has passed, and
    a worker samples it again, split at sample 1. The gate trains one of the two."""
    limits = StreamLimits(duplicate_window=1.0)

    async def worker(js, cuts: tuple[int, ...], seed: int) -> int:
        """Sample the next task as a worker numbers its attempt, publish it split after ``cuts``, ack it."""
        tasks = await pull_consumer(
            js, names.PROMPTS_STREAM, names.WORKERS_CONSUMER, filter_subject=names.PROMPTS_SUBJECT
        )
        [msg] = await tasks.fetch(1, timeout=10)
        attempt = PromptTask.from_bytes(msg.data).attempt(msg.metadata.num_delivered)
        await publish(js, parts(attempt, cuts, version=0, seed=seed))
        await tasks.ack(msg)
        return attempt

    async def body():
        async with trainer(nats.url, dataset, limits) as first:
            await first.tasks.publish_next(first.js)
            assert await worker(first.js, (2,), seed=0) == 1
        async with trainer(nats.url, dataset, limits) as restarted:
            for _ in range(100):  # polling, every 0.05 s, until the duplicate window has let the task in again
                restarted.tasks.next_step = 0
                await restarted.tasks.publish_next(restarted.js)
                if (await restarted.js.stream_info(names.PROMPTS_STREAM)).state.messages:
                    break
                await asyncio.sleep(0.05)
            assert await worker(restarted.js, (1,), seed=1) == 10001  # block 1, the restart's
            for _ in range(4):
                await restarted.gate.admit(await one(restarted, "part"), 0)
            assert restarted.gate.held_samples == N
            await restarted.gate.commit(step=0)
            assert restarted.gate.ledger == {
                TASK: {"attempt": 1, "step": 0, "parts": {f"{TASK}/0-2": 1, f"{TASK}/2-4": 2}}
            }
            assert restarted.gate.take_counts() == {"accepted": 2, "dropped:duplicate_attempt": 2}
        assert (await settled(nats.url))[1:] == ([], (0, 0))

    asyncio.run(asyncio.wait_for(body(), 60))

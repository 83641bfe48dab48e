"""A store filled to its cap, on a real nats-server (docs/design.md section 3; issue 38, item 4): the
worker's real ``handle`` publishing (its sampling a fixed batch per task), the trainer's real gate,
commit and ROLLOUTS trim, its task publisher; nothing of NATS is a stand-in.

1. The trainer away, more untrained batches than ROLLOUTS's cap holds: ROLLOUTS refuses the rest
   ("maximum bytes exceeded") and drops none; the worker naks those tasks by name (``store_full``).
2. The trainer back: it trains what is stored, purges what it trained, and the refused tasks come
   back and are trained: every task once, none lost.
3. The server's store used up (``max_file_store``): the trainer's dead letter is refused and nak'ed
   (``rejected_unstored``), its task publish refused by name, the worker's batch refused; with room
   again the letter is stored under its rule, the task trained. Neither the gate nor the worker ends.

Synchronisation is by the services' own log lines (a handler sets an event) and JetStream's state.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from dataclasses import replace

import numpy as np
import pytest
from nats.js.api import StreamConfig

from centerline.nats_server import EmbeddedNats
from centerline.synth import make_batch
from rollout_worker.main import WorkerMetrics
from rollout_worker.worker import Outcome, Tokenizer, Worker
from shared import names
from shared.config import Config
from shared.nats_client import StoreFull, connect, publish_acked, pull_consumer
from shared.settings import TrainerSettings, WorkerSettings
from shared.streams import StreamLimits, ensure_streams, sample_max_bytes
from shared.task import PromptTask
from shared.wire import encode_batch
from tests.processes import stored_messages
from trainer_service import store
from trainer_service.gate import Gate
from trainer_service.tasks import AttemptBlocks, Example, TaskPublisher

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # a row of the fault table (docs/operations.md)

VOCAB, K, N, TOKENS, VERSION = 64, 8, 4, 40, 3
SIZES = dict(rollout_top_logprobs_num=K, rollout_n=N, rollout_max_new_tokens=32, rollout_session_max_tokens=48)
CFG = Config(max_staleness=1, **SIZES)
ROOM = store.room(CFG, prompts_per_step=1)  # the steps in flight (3) at their largest
# the least --rollouts-max-bytes the trainer takes (check_with): every trained batch purged after its step
SETTINGS = TrainerSettings(prompts_per_step=1, rollouts_max_bytes=ROOM)
CAP = SETTINGS.store_caps(CFG)[0]
DLQ_CAP = 64 << 10
MAX_FILE_STORE = 1 << 20
TASKS = 10  # tasks the trainer published before it went away: more groups than ROLLOUTS holds
ACK_WAIT = 2.0  # the trainer's: a dead letter the full store refused comes back after it


def group(task: PromptTask, attempt: int):
    """A worker's sampling of ``task``: ``N`` samples of ``TOKENS`` tokens, contract-valid."""
    batch = make_batch(
        samples=N, tokens_per_sample=TOKENS, k=K, vocab_size=VOCAB, seed=zlib.crc32(task.task_id.encode())
    )
    return replace(
        batch,
        batch_id=f"{task.task_id}/a{attempt}",
        task_id=task.task_id,
        attempt=attempt,
        weight_version=VERSION,
        token_versions=np.full_like(batch.token_versions, VERSION),
        sample_ids=[f"{task.task_id}/a{attempt}/{i}" for i in range(N)],
    )


class Sampled(Worker):
    """The worker, its sampling a fixed group per task (the publish path is what runs)."""

    async def process(self, task: PromptTask, attempt: int = 1) -> Outcome:
        return Outcome([group(task, attempt)], np.zeros(N, np.float32), N * TOKENS)


class Lines(logging.Handler):
    """Every log line of the worker and the trainer; ``seen(*texts)``: an event set once a line holds them all."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []
        self.waiting: list[tuple[tuple[str, ...], asyncio.Event]] = []

    def emit(self, record):
        line = record.getMessage() + " " + str(getattr(record, "fields", ""))
        self.lines.append(line)
        for texts, event in self.waiting:
            if all(t in line for t in texts):
                event.set()  # every line here is logged on the test's event loop

    def seen(self, *texts: str) -> asyncio.Event:
        event = asyncio.Event()
        if any(all(t in line for t in texts) for line in self.lines):
            event.set()
        self.waiting.append((texts, event))
        return event


async def work(worker: Worker, consumer, stopping: asyncio.Event) -> None:
    """The worker's loop (``Worker.run`` without its connection and streams set-up: the test's caps stay)."""
    while not stopping.is_set():
        for msg in await consumer.fetch(1, timeout=0.2):
            await worker.handle(msg)


async def train(gate: Gate, js, done, trained: list[str]) -> None:
    """The trainer's loop (``trainer_service/service.py:drive``): gather a step, commit, trim ROLLOUTS;
    until ``done()``, asked each time a gather waited for batches in vain."""
    stopping = asyncio.Event()

    async def idle():
        if done():
            stopping.set()

    step = 0
    while not stopping.is_set():
        held = await gate.gather(N, VERSION, 0.5, stopping, min_samples=N, starved=idle)
        if stopping.is_set():
            await gate.release()
            return
        trained += [h.batch.batch_id for h in held]
        await gate.commit(step)
        step += 1
        gate.counts["store_trimmed"] += await store.trim(js, CAP, ROOM)


async def within(event: asyncio.Event, what: str, seconds: float = 60.0) -> None:
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except TimeoutError:
        raise AssertionError(f"not within {seconds:g}s: {what}") from None


def test_a_full_store_refuses_by_name_loses_nothing_and_trains_each_task_once(tmp_path):
    SETTINGS.check_with(CFG)  # a cap the trainer starts with
    assert CAP == ROOM == 3 * N * sample_max_bytes(CFG.rollout)
    lines = Lines()
    for name in ("centerline.worker", "centerline.trainer"):
        logging.getLogger(name).addHandler(lines)
        logging.getLogger(name).setLevel(logging.INFO)

    async def main():
        with EmbeddedNats(tmp_path / "nats", max_file_store=MAX_FILE_STORE) as server:
            nc = await connect(server.url)
            js = nc.jetstream()
            limits = StreamLimits(rollouts_max_bytes=CAP, dlq_max_bytes=DLQ_CAP, audit_max_bytes=64 << 10)
            await ensure_streams(js, limits)
            tasks = TaskPublisher(
                [Example("1+1=", "2", "exact_match", {})],
                run_id="r1",
                seed=0,
                prompts_per_step=1,
                n=N,
                blocks=AttemptBlocks(tmp_path / "attempt_blocks"),
            )
            cfg = Config(nats_url=server.url, **SIZES)
            metrics = WorkerMetrics()
            settings = WorkerSettings(worker_id="w1", vocab_size=VOCAB, nak_delay=0.25)
            worker = Sampled(cfg, settings, Tokenizer(None, None), metrics=metrics)
            prompts = await pull_consumer(
                js, names.PROMPTS_STREAM, names.WORKERS_CONSUMER, filter_subject=names.PROMPTS_SUBJECT, max_deliver=10
            )
            worker.nc, worker.js, worker.consumer = nc, js, prompts
            batches = await pull_consumer(
                js,
                names.ROLLOUTS_STREAM,
                names.TRAINER_CONSUMER,
                filter_subject=names.ROLLOUTS_SUBJECT,
                ack_wait=ACK_WAIT,
            )
            gate = Gate(js, batches, vocab_size=VOCAB, cfg=CFG, ledger={}, ack_wait=ACK_WAIT, run_id="r1")
            alive = asyncio.create_task(gate.keep_alive(ACK_WAIT / 3))
            out = {}

            # 1. the trainer away: the worker fills ROLLOUTS to its cap, then is refused
            refused = lines.seen("maximum bytes exceeded")
            for _ in range(TASKS):
                await tasks.publish_next(js)
            stop_worker = asyncio.Event()
            worker_loop = asyncio.create_task(work(worker, prompts, stop_worker))
            await within(refused, "a worker's publish refused by the full ROLLOUTS")
            out["full"] = (await js.stream_info(names.ROLLOUTS_STREAM)).state

            # 2. the trainer back: it trains what is stored and trims it; the refused tasks come back
            wanted = {f"r1/{s}/0" for s in range(TASKS)}
            trained: list[str] = []
            await asyncio.wait_for(train(gate, js, lambda: wanted <= set(gate.ledger), trained), 120)
            out["trained"], out["ledger"] = list(trained), dict(gate.ledger)
            out["phase2"] = gate.take_counts()
            out["worker_loop_alive"] = not worker_loop.done()
            stop_worker.set()
            await worker_loop

            # 3. the server's store used up: another run's batch waits in ROLLOUTS, one more task in PROMPTS
            other = group(
                PromptTask(task_id="r0/0/0", group_id="r0/0/0", prompt="x", answer="y", reward="e", n=N, step=0), 1
            )
            await js.publish(names.ROLLOUTS_SUBJECT, encode_batch(other), headers={names.MSG_ID_HEADER: "r0/0/0/a1"})
            await tasks.publish_next(js)  # r1/10/0
            await js.add_stream(StreamConfig(name="FILLER", subjects=["filler"], max_bytes=-1))
            with pytest.raises(StoreFull) as used_up:
                for i in range(2 * MAX_FILE_STORE // (64 << 10)):  # until JetStream says the store is used up
                    await publish_acked(js, "filler", bytes(64 << 10), {names.MSG_ID_HEADER: f"f{i}"})
            out["filler_refusal"] = used_up.value.description
            out["task_publish"] = await store.unless_full(tasks.publish_next(js), "tasks", gate.counts)
            unstored = lines.seen("not dead-lettered")
            server_full = lines.seen("store full, task will be retried", "insufficient resources")
            worker_loop = asyncio.create_task(work(worker, prompts, stop_worker := asyncio.Event()))
            trained3: list[str] = []
            trainer = asyncio.create_task(
                train(
                    gate,
                    js,
                    lambda: "r1/10/0" in gate.ledger and gate.counts["rejected:foreign_run"] == 1,
                    trained3,
                )
            )
            await within(unstored, "the trainer's dead letter refused by the full store")
            await within(server_full, "a publish refused by the server's full store")
            out["while_full"] = (not trainer.done(), not worker_loop.done(), dict(gate.counts))
            await js.delete_stream("FILLER")  # room again
            await asyncio.wait_for(trainer, 60)
            stop_worker.set()
            await worker_loop
            alive.cancel()
            worker.scorer.close()
            out["trained3"], out["phase3"] = trained3, gate.take_counts()
            out["letters"] = await stored_messages(server.url, names.DLQ_STREAM)
            out["advisories"] = await stored_messages(server.url, names.ADVISORIES_STREAM)
            out["prompts"] = await js.consumer_info(names.PROMPTS_STREAM, names.WORKERS_CONSUMER)
            out["rollouts"] = (await js.stream_info(names.ROLLOUTS_STREAM)).state
            out["outcomes"] = {
                o: metrics.tasks.labels(o)._value.get() for o in ("ok", "nak", "store_full", "rejected", "error")
            }
            await nc.close()
            return out

    try:
        out = asyncio.run(asyncio.wait_for(main(), 300))
    finally:
        for name in ("centerline.worker", "centerline.trainer"):
            logging.getLogger(name).removeHandler(lines)

    # 1. ROLLOUTS full: nothing discarded (its first message is still the first stored), the rest refused
    assert out["full"].first_seq == 1 and out["full"].bytes <= CAP
    assert out["full"].messages == 7 < TASKS  # 7 groups of 4 x 40 tokens fit the cap
    # 2. every task trained once, from one attempt; none twice, none lost; the trained batches purged
    assert sorted(out["ledger"]) == sorted(f"r1/{s}/0" for s in range(TASKS))
    assert len(out["trained"]) == len(set(out["trained"])) == TASKS
    assert len({b.rsplit("/a", 1)[0] for b in out["trained"]}) == TASKS
    assert out["phase2"]["accepted"] == TASKS
    # the trim purged a settled prefix of ROLLOUTS, every batch of phase 2 at least, none unsettled
    trimmed = out["phase2"]["store_trimmed"] + out["phase3"]["store_trimmed"]
    assert trimmed == out["rollouts"].first_seq - 1 >= TASKS and out["phase2"]["store_trimmed"] > 0
    assert out["worker_loop_alive"]
    # 3. the server's store full: the trainer's refusals named and survived, the worker's too
    assert out["filler_refusal"] == "insufficient resources"
    assert out["task_publish"] is False
    gate_alive, worker_alive, counts = out["while_full"]
    assert gate_alive and worker_alive and counts["rejected_unstored"] >= 1 and counts["store_full"] == 1
    assert out["trained3"] == [b for b in out["trained3"] if b.startswith("r1/10/0/a")] and len(out["trained3"]) == 1
    assert out["phase3"]["rejected:foreign_run"] == 1 and out["phase3"]["accepted"] == 1
    (letter,) = out["letters"]  # stored once, under its rule, once the store had room
    assert (letter.headers["rule"], letter.headers["batch_id"]) == ("foreign_run", "r0/0/0/a1")
    assert "of run 'r0'; this trainer runs 'r1'" in letter.headers["reason"]
    # the worker: refused publishes nak'ed as store_full, never rejected, never an error; nothing given up
    outcomes = out["outcomes"]
    assert outcomes["store_full"] >= 2 and outcomes["rejected"] == outcomes["error"] == 0
    assert outcomes["ok"] == TASKS + 1
    assert [m.subject for m in out["advisories"]] == []
    assert (out["prompts"].num_pending, out["prompts"].num_ack_pending) == (0, 0)  # r1/11/0 was never stored
    assert any("store full, task will be retried" in line and "maximum bytes exceeded" in line for line in lines.lines)
    assert any("store full, task will be retried" in line and "insufficient resources" in line for line in lines.lines)
    assert any(
        line.startswith("tasks not published: task 'r1/11/0' not stored: the NATS server's") for line in lines.lines
    )

"""Acked means durable (issue #8, item 1): the NATS server is SIGKILLed while batches are
published, and restarted on the same data directory and port.

- ``test_every_acked_batch_survives_sigkill_and_is_stored_once``: a worker-like publisher
  (``publish_batch``, each failed publish retried with the same batch_id, as a NAKed task
  would be) and four kills: mid-publish, right after a burst of acked publishes (what a
  write-behind cache would lose), between the store and its PubAck (the retry after the
  restart must be a duplicate), and right after the last ack.
- ``test_a_run_survives_sigkill_of_the_server_while_publishing_and_while_committing``: the
  whole system, the server killed twice at exact points (see ``relay.py``).
- two worker behaviours those faults exposed: a SIGTERM while NATS is down, and a task ack
  lost after the task's batches were stored;
- ``..._while_the_trainer_publishes_tasks``: the trainer's task publish lost in a restart is
  sent again (``shared.nats_client.publish_acked``; the trainer used to exit 1 there).

The first two print one ``RELIABILITY`` line with the figures of the closing note (``pytest -s``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from centerline.nats_server import EmbeddedNats
from centerline.synth import make_batch
from rollout_worker.publish import publish_batch
from shared import names
from shared.nats_client import PublishError, connect
from shared.streams import ensure_streams
from shared.task import PromptTask
from shared.wire import decode_batch, encode_batch
from tests.processes import wait_until
from tests.reliability.relay import ACK, Relay
from tests.reliability.topology import (
    Figures,
    consumers,
    leftovers,
    run_accounting,
    server_sync_always,
    stream_messages,
)
from tests.trainer_service.service_stack import descendants

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BATCHES = 60


class Publisher:
    """Publishes ``BATCHES`` batches in order, each failed publish again with the same batch_id
    (after the test lets it go, when ``hold`` is set). ``acked`` maps batch_id to the PubAck's
    duplicate flag."""

    def __init__(self, nc, js):
        self.nc, self.js = nc, js
        self.data = [
            encode_batch(
                make_batch(samples=4, tokens_per_sample=6, k=16, vocab_size=260, seed=i, batch_id=f"pub/{i:03d}")
            )
            for i in range(BATCHES)
        ]
        self.acked: dict[str, bool] = {}
        self.failed: list[str] = []  # batch_id of each failed attempt
        self.errors: Counter = Counter()  # exception types of failed attempts
        self.go = asyncio.Event()
        self.go.set()
        self.idle = asyncio.Event()
        self.hold = False  # pause after the next failed publish

    async def run(self) -> None:
        for i, data in enumerate(self.data):
            batch_id = f"pub/{i:03d}"
            while batch_id not in self.acked:
                if not self.go.is_set():
                    self.idle.set()
                    await self.go.wait()
                    self.idle.clear()
                try:
                    [ack] = await publish_batch(
                        self.js, data, max_payload=self.nc.max_payload, batch_id=batch_id, timeout=1.0, attempts=1
                    )
                    self.acked[batch_id] = bool(ack.duplicate)
                # counted by type; the test requires PublishError
                except Exception as exc:  # noqa: BLE001
                    self.errors[type(exc).__name__] += 1
                    self.failed.append(batch_id)
                    if self.hold:  # the test decides when the retry goes out
                        self.go.clear()

    async def pause(self) -> None:
        self.go.clear()
        await self.idle.wait()


async def until(check, deadline_s: float, what: str):
    """Poll ``check()`` (sync) on the event loop until truthy; the loop keeps the publisher running."""
    end = time.monotonic() + deadline_s
    while not (value := check()):
        if time.monotonic() > end:
            raise TimeoutError(f"{what} not reached after {deadline_s}s")
        await asyncio.sleep(0.001)  # polling interval, not synchronisation
    return value


def test_every_acked_batch_survives_sigkill_and_is_stored_once(tmp_path):
    server = EmbeddedNats(tmp_path / "nats", http_port=0).start()
    port = server.port
    kills = []

    def crash(point: str) -> None:
        server.kill()  # SIGKILL; blocks the loop, as a crash stops the server between two client writes
        kills.append((point, len(publisher.acked)))
        server.start()
        assert server.port == port

    async def main():
        nonlocal publisher
        nc = await connect(server.url)
        js = nc.jetstream()
        await ensure_streams(js)
        publisher = Publisher(nc, js)
        task = asyncio.create_task(publisher.run())

        # 1. mid-publish: the next publish is on its way when the server dies
        await until(lambda: len(publisher.acked) >= 12, 30, "12 batches acked")
        crash("mid-publish")

        # 2. right after a burst of acked publishes, nothing in flight
        await until(lambda: len(publisher.acked) >= 30, 30, "30 batches acked")
        await publisher.pause()
        reconnects = nc.stats["reconnects"]
        crash("after acked burst")
        await until(lambda: nc.stats["reconnects"] > reconnects and nc.is_connected, 20, "the client reconnected")

        # 3. stored, PubAck lost: the server stalls (SIGSTOP) until the publish times out, then
        #    stores it, and dies before the publisher tries again
        server.proc.send_signal(signal.SIGSTOP)
        failures, publisher.hold = len(publisher.failed), True
        publisher.go.set()
        await until(lambda: len(publisher.failed) > failures, 10, "a publish timing out on the stalled server")
        lost_ack = publisher.failed[-1]
        await publisher.pause()
        server.proc.send_signal(signal.SIGCONT)
        await until_stored(server.url, lost_ack)
        crash("stored, PubAck lost")
        publisher.hold = False
        publisher.go.set()

        # 4. right after the last ack
        await asyncio.wait_for(task, 60)
        crash("after the last ack")
        await nc.close()
        return lost_ack

    publisher = None
    try:
        lost_ack = asyncio.run(main())
        stored = asyncio.run(stream_messages(server.url))
        sync_always = server_sync_always(server)
    finally:
        server.stop()

    acked = publisher.acked
    ids = Counter(decode_batch(bytes(data)).batch_id for _, _, data in stored)
    by_id = {decode_batch(bytes(data)).batch_id: data for _, _, data in stored}
    figures = Figures(
        faults=len(kills),
        published=len(stored),
        acked=len(acked),
        lost=len(set(acked) - set(ids)),
        duplicated=sum(n - 1 for n in ids.values()),
        notes={"kills": kills, "failed_publishes": dict(publisher.errors), "sync_always": sync_always},
    )
    print("\n" + figures.summary("nats-publisher"))
    assert len(kills) == 4 and len(acked) == BATCHES
    assert (figures.lost, figures.duplicated, figures.published) == (0, 0, BATCHES)
    for i, data in enumerate(publisher.data):  # byte for byte
        assert by_id[f"pub/{i:03d}"] == data
    assert all(headers.get(names.MSG_ID_HEADER) == decode_batch(bytes(data)).batch_id for _, headers, data in stored)
    assert set(publisher.errors) <= {PublishError.__name__}  # what a worker NAKs on; anything else escapes it
    assert acked[lost_ack] is True  # the retry after the restart was recognised as already stored
    # A SIGKILL of the server alone cannot tell an fsync from a write to the page cache (nats-server
    # 2.15 writes each message before its PubAck either way): the running server must say it syncs.
    assert sync_always, "the running server does not fsync before acking (sync_interval: always is missing)"


async def until_stored(url: str, batch_id: str, deadline_s: float = 10.0) -> None:
    nc = await connect(url)
    js = nc.jetstream()
    try:
        end = time.monotonic() + deadline_s
        while True:
            try:
                msg = await js.get_last_msg(names.ROLLOUTS_STREAM, names.ROLLOUTS_SUBJECT)
                if decode_batch(bytes(msg.data)).batch_id == batch_id:
                    return
            # the stalled server answers late
            except Exception:  # noqa: BLE001
                pass
            if time.monotonic() > end:
                raise TimeoutError(f"{batch_id} not stored after {deadline_s}s")
            await asyncio.sleep(0.01)  # polling interval
    finally:
        await nc.close()


STEPS = 8


def test_a_run_survives_sigkill_of_the_server_while_publishing_and_while_committing(topology):
    """Two real workers and the 2-rank trainer, all through ``Relay``; the server is SIGKILLed
    (1) just after a worker's batch publish reached it, before the worker could ack its task,
    while the trainer gathers a step, and (2) just after the trainer's first ack of a committed
    step reached it, the step's other acks not: that batch comes back after the restart, and
    only the ledger stops it being trained twice. The run must reach every step."""
    server = topology.server
    relay = Relay(server.port)
    kills = []

    def crash(point: str) -> None:
        server.kill()
        kills.append((point, topology.steps_done()))  # where, and after how many steps
        server.start()  # same data directory, same port: every client reconnects through the relay

    try:
        workers = [topology.add_worker(f"w{i}", nats_url=relay.url) for i in range(2)]
        trainer = topology.start_trainer(STEPS, nats_url=relay.url)
        for w in workers:
            w.wait_ready()
        wait_until(lambda: topology.steps_done() >= 1, 120, "step 1", trainer.proc)

        relay.arm("client", names.ROLLOUTS_SUBJECT)
        wait_until(relay.tripped.is_set, 60, "a worker publishing a batch", trainer.proc)
        published = decode_batch(relay.trip.body)
        crash("a batch published, its task not acked")

        wait_until(lambda: topology.steps_done() >= 3, 120, "step 3", trainer.proc)
        relay.arm("client", "$JS.ACK.ROLLOUTS.", ACK)
        wait_until(relay.tripped.is_set, 60, "the trainer acking a committed step", trainer.proc)
        crash("the trainer's first ack of a step")

        code = trainer.wait(150)
        assert code == 0, trainer.log()
        topology.wait_drained()
        figures, run = run_accounting(topology.nats, topology.run_dir, STEPS, topology.workers)
        sync_always = server_sync_always(server)
    finally:
        relay.close()

    dropped = sum(m["gate_duplicate"] for m in run["metrics"])
    figures.faults = len(kills)
    figures.notes.update({"kills": kills, "ledger_dropped_redeliveries": dropped, "sync_always": sync_always})
    print("\n" + figures.summary("nats-full-run"))
    assert [m["step"] for m in run["metrics"]] == list(range(1, STEPS + 1))
    assert (figures.lost, figures.duplicated, figures.dead_lettered, figures.groups_twice) == (0, 0, 0, 0)
    assert run["ledger_matches_stream"] and set(run["trained"]) == run["expected"]
    assert run["acked"] <= set(run["stored_ids"])  # acked means stored
    assert run["stored_ids"][published.batch_id] == 1  # stored once though its task ran again
    # the committed step's unacked batch came back (with any trained batch whose ack the crash
    # took: JetStream's consumer acks are not fsynced), and the ledger dropped it
    assert dropped >= 1
    assert leftovers(run) == []
    assert all(w.proc.poll() is None for w in topology.workers)  # the workers lived through both crashes
    assert sync_always


def test_a_worker_stopped_while_the_server_is_down_exits_0(topology):
    """SIGTERM with NATS unreachable: nothing can be flushed and nothing needs to be (unacked
    tasks come back after ack_wait), so the worker says so and exits 0, not with a traceback."""
    worker = topology.add_worker("w0")
    worker.wait_ready()
    topology.server.kill()
    assert worker.stop() == 0, worker.log()[-3000:]
    assert '"worker stopped"' in worker.log() and "Traceback" not in worker.log()


def test_a_lost_task_ack_is_logged_and_the_task_comes_back_stored_once(topology):
    """The worker's batch reaches the server, its task ack does not (the relay cuts the
    connection right after the publish, then resets it). The worker logs the lost ack, stays up,
    and handles the redelivered task as attempt 2, whose batch is stored under its own id
    (``#2``): the trainer trains one attempt of a task and drops the other as
    ``duplicate_attempt`` (test_worker_churn.py, test_split_task.py)."""
    relay = Relay(topology.server.port)
    try:
        worker = topology.add_worker("w0", nats_url=relay.url)
        worker.wait_ready()
        relay.arm("client", names.ROLLOUTS_SUBJECT)
        task = PromptTask(
            task_id="lost-ack/0/0",
            group_id="lost-ack/0/0",
            prompt="copy abc=",
            answer="abc",
            reward="exact",
            n=4,
            step=0,
        )
        asyncio.run(publish_task(topology.nats, task))
        wait_until(relay.tripped.is_set, 60, "the worker publishing the task's batch", worker.proc)
        # its task ack, sent once the batch's PubAck is in (the server's answers still pass): reset
        # earlier, the PubAck is lost instead, and the publish's retry (deduplicated) precedes an ack
        # that then gets through
        acked = lambda: relay.withheld_subject("$JS.ACK.PROMPTS.", ACK)  # noqa: E731 (not its in-progress acks)
        wait_until(acked, 60, "the worker acking its task", worker.proc)
        relay.drop()
        wait_until(lambda: '"task done"' in worker.log(), 60, "the redelivered task done", worker.proc)
        stored = [decode_batch(bytes(data)) for _, _, data in asyncio.run(stream_messages(topology.nats))]
        info = asyncio.run(consumers(topology.nats))
    finally:
        relay.close()
    lost = [json.loads(line) for line in worker.log().splitlines() if '"task ack lost' in line]
    assert [(x["task_id"], x["batches"]) for x in lost] == [(task.task_id, [task.task_id])]
    assert "Task exception was never retrieved" not in worker.log()
    assert [(b.batch_id, b.task_id, b.attempt) for b in stored] == [
        (task.task_id, task.task_id, 1),
        (f"{task.task_id}#2", task.task_id, 2),
    ]
    assert info == {names.WORKERS_CONSUMER: (0, 0)}
    assert worker.proc.poll() is None


async def publish_task(url: str, task: PromptTask) -> None:
    nc = await connect(url)
    await nc.jetstream().publish(names.PROMPTS_SUBJECT, task.to_bytes(), headers={names.MSG_ID_HEADER: task.task_id})
    await nc.close()


def test_a_run_survives_sigkill_of_the_server_while_the_trainer_publishes_tasks(topology):
    """The trainer's first task publish of a step reaches the server, the next does not, and the
    server dies: the lost publish must be sent again (same task_id, so JetStream keeps one)."""
    relay = Relay(topology.server.port)
    try:
        worker = topology.add_worker("w0")
        trainer = topology.start_trainer(4, nats_url=relay.url)
        worker.wait_ready()
        wait_until(lambda: topology.steps_done() >= 1, 120, "step 1", trainer.proc)
        relay.arm("client", names.PROMPTS_SUBJECT)
        wait_until(relay.tripped.is_set, 60, "the trainer publishing a task", trainer.proc)
        topology.server.kill()
        topology.server.start()
        code = trainer.wait(120)
    finally:
        relay.close()
    assert code == 0, trainer.log()
    assert topology.steps_done() == 4


def rank_0(trainer) -> int:
    """The pid of the trainer's rank 0 (torchrun sets RANK in each rank's environment)."""
    for pid in descendants(trainer.proc.pid):
        try:
            if b"RANK=0" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return pid
        except OSError:
            continue
    raise AssertionError(f"no rank 0 under torchrun pid {trainer.proc.pid}")


def test_a_trainer_stopped_while_the_server_is_down_exits_0(topology):
    """SIGTERM to the 2-rank trainer's rank 0 with NATS gone: whatever its flush and close
    meet, it sends the stop to rank 1, so both ranks leave cleanly."""
    worker = topology.add_worker("w0")
    trainer = topology.start_trainer(50)
    worker.wait_ready()
    wait_until(lambda: topology.steps_done() >= 1, 120, "step 1", trainer.proc)
    topology.server.kill()
    os.kill(
        rank_0(trainer), signal.SIGTERM
    )  # SIGTERM to torchrun itself would make torchrun exit 1 whatever the ranks do
    assert trainer.wait(90) == 0, trainer.log()
    assert "Traceback" not in trainer.log()

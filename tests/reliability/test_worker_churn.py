"""Workers come and go (issue #8, item 3): the run starts with one real worker, scales to four,
loses two to SIGKILL at exact points of a task, scales down by SIGTERM, and must still train
every prompt group of every step exactly once.

The kill points are set with ``Relay`` (every worker's NATS connection runs through it):
- just after a worker was handed a task: it dies holding the task, nothing published;
- just after a worker's batch reached JetStream, before its task ack: the task comes back,
  another worker samples the group again as attempt 2 and publishes it under the attempt's own
  batch_id (``T#2``), and only the trainer's exactly-once per task group keeps the group from
  being trained twice: attempt 1 is trained, attempt 2 dropped as ``duplicate_attempt``.

The trainer runs the asynchronous default (``--max-inflight-steps 2``); a batch a fault held
back past ``--max-staleness`` is dropped as stale and its task sampled again (``topology.py``).

Prints one ``RELIABILITY`` line with the figures of the closing note (``pytest -s``).
"""

from __future__ import annotations

import json
import signal
from contextlib import contextmanager

import pytest

from shared import names
from shared.task import PromptTask
from shared.wire import decode_batch
from tests.processes import wait_until
from tests.reliability.relay import Relay
from tests.reliability.topology import leftovers, run_accounting

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 60  # about a third of a second each here: the faults come in the first few steps after the scale-up


@contextmanager
def frozen(proc):
    """``proc`` stopped (SIGSTOP) inside the block and running again (SIGCONT) after it, whatever happened."""
    proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGCONT)


def test_workers_killed_mid_task_and_scaled_up_and_down_lose_no_group_and_train_none_twice(topology):
    relay = Relay(topology.server.port)
    workers = {}

    def add(name: str):
        workers[name] = topology.add_worker(name, nats_url=relay.url)
        return workers[name]

    def tripped() -> str:  # the worker id of the client the relay cut
        return relay.trip.client.removeprefix("centerline-worker-")

    def sigkill(worker) -> None:
        worker.proc.send_signal(signal.SIGKILL)
        worker.proc.wait()

    try:
        trainer = topology.start_trainer(STEPS)
        add("w0").wait_ready()
        wait_until(lambda: topology.steps_done() >= 1, 120, "step 1", trainer.proc)
        # The proxy frozen while three more workers start, so the run cannot end before it is at
        # scale: their start-up takes longer than the whole run on 2 busy cores. Requests wait
        # in its socket and workers keep their tasks alive with in-progress acks meanwhile.
        with frozen(topology.upstream.proxy_process.proc):
            for w in [add(f"w{i}") for i in (1, 2, 3)]:  # scale up to 4
                w.wait_ready()
        at_scale = topology.steps_done()

        relay.arm("server", "$JS.ACK.PROMPTS.")  # 1. a worker just handed a task
        wait_until(relay.tripped.is_set, 60, "a task handed to a worker", trainer.proc)
        holder, held = tripped(), PromptTask.from_bytes(relay.trip.body)
        sigkill(workers[holder])

        relay.arm("client", names.ROLLOUTS_SUBJECT)  # 2. a worker's batch stored, its task not acked
        wait_until(relay.tripped.is_set, 60, "a worker publishing a batch", trainer.proc)
        publisher, published = tripped(), decode_batch(relay.trip.body)
        sigkill(workers[publisher])

        wait_until(lambda: topology.steps_done() >= at_scale + 2, 120, "2 more steps", trainer.proc)
        leaving = next(name for name, w in workers.items() if w.proc.poll() is None)
        assert workers[leaving].stop() == 0, workers[leaving].log()[-3000:]  # 3. scale down: SIGTERM

        code = trainer.wait(240)
        assert code == 0, trainer.log()
        topology.wait_drained()
        figures, run = run_accounting(topology.nats, topology.run_dir, STEPS, topology.workers)
    finally:
        relay.close()

    # a worker logs its task done after the ack the drained consumer shows: wait for the line
    republished_by = wait_until(
        lambda: sorted(
            name for name, w in workers.items() if name != publisher and task_done(w, published.group_ids[0])
        ),
        30,
        f"another worker's task done line for {published.group_ids[0]}",
    )
    figures.faults = 3
    figures.notes.update(
        {
            "workers": len(workers),
            "sigkill_holding_task": (holder, held.task_id),
            "sigkill_after_publish": (publisher, published.batch_id),
            "republished_by": republished_by,
            "sigterm": leaving,
            "steps_done_at_4_workers": at_scale,
        }
    )
    print("\n" + figures.summary("worker-churn"))
    assert [m["step"] for m in run["metrics"]] == list(range(1, STEPS + 1))
    assert (figures.lost, figures.duplicated, figures.dead_lettered, figures.groups_twice) == (0, 0, 0, 0)
    assert run["ledger_matches_stream"] and set(run["trained"]) == run["expected"]
    assert run["acked"] <= set(run["stored_ids"])
    # the killed holder's task was sampled again elsewhere and trained once
    assert all(run["trained"][f"{held.task_id}/{i}"] == 1 for i in range(held.n))
    assert not task_done(workers[holder], held.task_id)
    # the batch stored before its worker died is the one copy kept; the task ran again elsewhere
    assert run["stored_ids"][published.batch_id] == 1 and run["producers"][published.batch_id] == publisher
    assert leftovers(run) == []


def task_done(worker, task_id: str) -> bool:
    return any(
        line.startswith("{") and json.loads(line).get("msg") == "task done" and json.loads(line)["task_id"] == task_id
        for line in worker.log().splitlines()
    )

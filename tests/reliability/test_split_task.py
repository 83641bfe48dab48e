"""Exactly once per task group (issue #23, item 3): a worker dies between two publishes of one
task's split batch, the task is redelivered and sampled again as attempt 2, and the group is
trained once, under attempt 2 whole; attempt 1's stored part is dropped as ``duplicate_attempt``.

The embedded NATS server's ``max_payload`` is set so that every group of 4 samples is split
into parts of one or two samples. The first worker runs with the failpoint
``worker.between_parts@1=kill`` and one task at a time: the first task it publishes leaves one
part of its attempt 1 in the stream and the worker SIGKILLed. A second worker, started with it
and without the failpoint, takes the redelivered task after ``ack_wait``. The trainer runs the
asynchronous default. Prints one ``RELIABILITY`` line (``pytest -s``).
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from centerline.synth import make_batch
from rollout_worker.publish import HEADER_ROOM
from shared.faults import ENV
from shared.wire import decode_batch, encode_batch
from tests.reliability.topology import Topology, leftovers, run_accounting, stream_messages
from tests.rollout_worker.test_worker_stack import K

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 6
# Two samples of the longest response here (6 tokens, K candidates, a prompt of at most 24 ids)
# and room for the split's own bound on headers: a group of 4 never fits, one sample always does.
MAX_PAYLOAD = HEADER_ROOM + len(encode_batch(make_batch(samples=2, tokens_per_sample=6, k=K, prompt_len=24))) + 300


@pytest.fixture
def split_topology(upstream, sglang, tmp_path):
    topo = Topology(tmp_path, upstream, max_payload=MAX_PAYLOAD)
    yield topo
    topo.close()


def test_a_worker_killed_between_two_publishes_of_a_task_leaves_its_group_trained_once(split_topology):
    topology = split_topology
    dying = topology.add_worker("w0", "--concurrency", "1", env={ENV: "worker.between_parts@1=kill"})
    spare = topology.add_worker("w1")
    dying.wait_ready()
    spare.wait_ready()
    trainer = topology.start_trainer(STEPS, "--ack-wait", "10")  # pending parts expire after 20 s, not 6
    assert dying.proc.wait(timeout=120) == -9, dying.log()[-3000:]
    assert "failpoint worker.between_parts at step 1: kill" in dying.log()
    code = trainer.wait(240)
    assert code == 0, trainer.log()
    topology.wait_drained()
    figures, run = run_accounting(topology.nats, topology.run_dir, STEPS, topology.workers)

    stored = [decode_batch(bytes(data)) for _, _, data in asyncio.run(stream_messages(topology.nats))]
    per_attempt = Counter((b.task_id, b.attempt) for b in stored)
    incomplete = [
        (key, n) for key, n in per_attempt.items() if n < next(b.parts for b in stored if (b.task_id, b.attempt) == key)
    ]
    figures.faults = 1
    figures.notes.update({"max_payload": MAX_PAYLOAD, "incomplete_attempts": incomplete})
    print("\n" + figures.summary("split-task"))

    assert all(b.parts >= 2 for b in stored)  # every group was split
    [((task, attempt), count)] = incomplete
    assert (attempt, count) == (1, 1)  # the dying worker's attempt 1: one part stored
    entry = run["state"]["ledger"][task]
    assert entry["attempt"] == 2 and len(entry["parts"]) == per_attempt[(task, 2)]  # attempt 2, whole
    assert run["attempts"][task] == {2}
    assert figures.groups_twice == 0 and all(len(a) == 1 for a in run["attempts"].values())
    assert (figures.lost, figures.duplicated, figures.dead_lettered) == (0, 0, 0)
    assert figures.dropped == {"duplicate_attempt": 1}
    assert run["ledger_matches_stream"] and set(run["trained"]) == run["expected"]
    assert all(n == 1 for n in run["trained"].values())
    assert [m["step"] for m in run["metrics"]] == list(range(1, STEPS + 1))
    assert leftovers(run) == []


def test_a_part_held_back_past_max_staleness_is_dropped_as_stale_and_its_task_sampled_again(split_topology):
    """The first worker sleeps 15 s between the two publishes of its first task, its whole process
    (the failpoint blocks its event loop, so no in-progress ack goes out), with its task kept by a
    60 s ack wait (both workers set it: the last to bind the consumer decides): the second part
    reaches the gate more than ``--max-staleness`` versions old and is dead-lettered as stale, the
    trainer publishes the task again, the other worker samples it as attempt 11001 (block 1, published
    again once, delivery 1: docs/design.md section 10), which is trained;
    attempt 1's first part, pending, is dropped then."""
    topology = split_topology
    slow = topology.add_worker(
        "w0", "--concurrency", "1", "--ack-wait", "60", env={ENV: "worker.between_parts@1=sleep:15"}
    )
    spare = topology.add_worker("w1", "--ack-wait", "60")
    slow.wait_ready()
    spare.wait_ready()
    steps = 20
    trainer = topology.start_trainer(steps, "--ack-wait", "10")  # pending parts expire after 20 s
    code = trainer.wait(300)
    assert code == 0, trainer.log()
    topology.wait_drained()
    figures, run = run_accounting(topology.nats, topology.run_dir, steps, topology.workers)
    resampled = sum(m["gate_resampled"] for m in run["metrics"])
    figures.faults = 1
    figures.notes.update({"resampled": resampled})
    print("\n" + figures.summary("split-task-stale"))

    assert "failpoint worker.between_parts at step 1: sleep:15" in slow.log()
    # Attempt 1's second part meets the gate 15 s late, many versions stale: dead-lettered as such,
    # its task published again and sampled as attempt 11001 (the ack wait keeps the consumer from
    # redelivering it meanwhile); attempt 1's first part, pending, is dropped once attempt 11001 is trained.
    assert figures.dropped == {"stale": 1, "duplicate_attempt": 1}, figures.dropped
    assert resampled == 1
    [task] = [t for t, attempts in run["attempts"].items() if attempts != {1}]
    assert run["attempts"][task] == {11001} and run["state"]["ledger"][task]["attempt"] == 11001
    assert (figures.lost, figures.duplicated, figures.dead_lettered, figures.groups_twice) == (0, 0, 0, 0)
    assert run["ledger_matches_stream"] and set(run["trained"]) == run["expected"]
    assert all(n == 1 for n in run["trained"].values())
    assert leftovers(run) == []

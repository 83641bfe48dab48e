"""The reliability suite at cluster size: the whole system (two real workers, the 2-rank
trainer, the proxy before the session's SGLang server) on a three-node JetStream cluster with
three replicas of every stream, while

1. the node leading ROLLOUTS is cut off from the other two (its routes cut in ``partition.py``'s
   links; clients connected to it stay connected) until the majority has elected a new leader,
   then healed;
2. every node is restarted in turn (SIGTERM, start again on its store, the cluster healthy
   again before the next), as a rolling upgrade does.

The run must reach every step with every sample trained exactly once and every acked batch
stored once. It prints one ``RELIABILITY`` line (``pytest -s``).
"""

from __future__ import annotations

import asyncio

import nats
import nats.js.errors
import pytest

from shared import names
from shared.nats_client import connect
from tests.processes import wait_until
from tests.reliability.partition import PartitionableCluster
from tests.reliability.topology import Topology, leftovers, run_accounting

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]
STEPS = 40
# Each step takes at least this long on rank 0 (a failpoint's sleep in the step's thread, as a real
# model's forward and backward would), so both faults land while the run goes on (checked below):
# toy steps under the asynchronous default are otherwise faster than an election and three restarts.
STEP_S = 0.5


async def rollouts_leader(url: str) -> str | None:
    """The node leading ROLLOUTS as the nodes at ``url`` see it; None while there is none."""
    nc = await connect(url, max_reconnect_attempts=1)
    try:
        return (await nc.jetstream().stream_info(names.ROLLOUTS_STREAM)).cluster.leader
    except (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.APIError):
        return None  # no leader yet: the request times out, finds no responder or a 503
    finally:
        await nc.close()


def test_a_run_survives_a_partitioned_stream_leader_and_a_rolling_restart(upstream, sglang, tmp_path):
    cluster = PartitionableCluster(tmp_path / "nats", 3).start()
    topology = Topology(tmp_path, upstream, server=cluster)
    faults = []
    try:
        workers = [topology.add_worker(f"w{i}") for i in range(2)]
        trainer = topology.start_trainer(STEPS, failpoints=f"trainer.train=sleep:{STEP_S}")
        for w in workers:
            w.wait_ready()
        wait_until(lambda: topology.steps_done() >= 2, 180, "step 2", trainer.proc)

        leader = asyncio.run(rollouts_leader(cluster.url))
        k = int(leader.removeprefix("n"))
        majority = ",".join(node.url for i, node in enumerate(cluster.nodes) if i != k)
        cluster.isolate(k)
        faults.append(f"partition:{leader}@step{topology.steps_done()}")
        # not tied to the trainer: the election takes seconds whatever the run does meanwhile
        wait_until(lambda: asyncio.run(rollouts_leader(majority)) not in (None, leader), 60, "a new leader")
        cluster.heal(k)
        cluster.wait_healthy(60)

        wait_until(lambda: topology.steps_done() >= 10, 240, "step 10", trainer.proc)
        for node in cluster.nodes:
            node.stop()
            node.start()
            cluster.wait_healthy(60)
            faults.append(f"restart:{node.server_name}@step{topology.steps_done()}")

        assert trainer.wait(300) == 0, trainer.log()
        topology.wait_drained()
        figures, run = run_accounting(topology.nats, topology.run_dir, STEPS, topology.workers)
        alive = all(w.proc.poll() is None for w in topology.workers)  # the workers lived through every fault
    finally:
        topology.close()

    # every fault landed while the trainer still had steps to go
    assert all(int(where.rsplit("@step", 1)[1]) < STEPS for where in faults), faults
    figures.faults = len(faults)
    figures.notes["where"] = faults
    print("\n" + figures.summary("nats-cluster"))
    assert [m["step"] for m in run["metrics"]] == list(range(1, STEPS + 1))
    assert (figures.lost, figures.duplicated, figures.dead_lettered, figures.groups_twice) == (0, 0, 0, 0), (
        figures.summary("nats-cluster")
    )
    assert run["ledger_matches_stream"] and set(run["trained"]) == run["expected"]
    assert run["acked"] <= set(run["stored_ids"])  # acked means stored, also across the faults
    assert leftovers(run) == []
    assert alive

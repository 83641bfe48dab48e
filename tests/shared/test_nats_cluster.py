"""A JetStream cluster of three real nats-servers on loopback: `centerline nats --cluster 3`,
streams with three replicas, the replica setting checked against the cluster, and a stream that
outlives the SIGKILL of its leader with every acked message."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from centerline.nats_server import EmbeddedNats, NatsCluster
from shared import names
from shared.nats_client import PublishError, connect, publish_acked, pull_consumer, servers
from shared.streams import StreamConfigError, StreamLimits, ensure_streams

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def test_a_comma_separated_url_is_a_server_list():
    assert servers("nats://a:4222,nats://b:4223") == ["nats://a:4222", "nats://b:4223"]
    assert servers("nats://a:4222") == "nats://a:4222"


def test_the_nats_command_starts_a_three_node_cluster_with_replicated_streams(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "centerline", "nats", "--cluster", "3", "--port", "0", "--data-dir", str(tmp_path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        ready = json.loads(proc.stdout.readline())
        urls = ready["url"].split(",")
        assert len(urls) == 3 and ready["replicas"] == 3
        assert set(ready["streams"].values()) == {"created"}

        async def replicas():
            nc = await connect(urls[2])  # any node serves the whole cluster
            try:
                info = await nc.jetstream().stream_info(names.ROLLOUTS_STREAM)
                return info.config.num_replicas, info.cluster.leader, len(info.cluster.replicas)
            finally:
                await nc.close()

        count, leader, followers = asyncio.run(replicas())
        assert (count, followers) == (3, 2) and leader in {"n0", "n1", "n2"}
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


@pytest.mark.parametrize("argv", [["--cluster", "3", "--replicas", "4"], ["--cluster", "0"]])
def test_the_nats_command_refuses_impossible_sizes(argv, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "centerline", "nats", *argv, "--port", "0", "--data-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert argv[1] in out.stderr and ("--replicas" in out.stderr or "--cluster" in out.stderr)


def test_more_replicas_than_nodes_is_a_clear_error(tmp_path):
    async def create(url):
        nc = await connect(url)
        try:
            await ensure_streams(nc.jetstream(), StreamLimits(replicas=3))
        finally:
            await nc.close()

    with EmbeddedNats(tmp_path / "single") as server, pytest.raises(StreamConfigError) as single:
        asyncio.run(create(server.url))
    with NatsCluster(tmp_path / "pair", 2) as cluster, pytest.raises(StreamConfigError) as pair:
        asyncio.run(create(cluster.url))
    for error in (single, pair):
        message = str(error.value)
        assert message.startswith(f"stream {names.PROMPTS_STREAM}: nats_stream_replicas=3, but the NATS deployment")
        assert "lower nats_stream_replicas to the cluster size" in message


@pytest.mark.slow  # a row of the README's fault table: `-m slow` selects it
def test_acked_messages_survive_the_sigkill_of_the_stream_leader(tmp_path):
    with NatsCluster(tmp_path, 3) as cluster:

        async def publish(js, first, count):
            acks = [
                await publish_acked(js, names.ROLLOUTS_SUBJECT, b"m", {names.MSG_ID_HEADER: f"m{i}"})
                for i in range(first, first + count)
            ]
            return [ack.seq for ack in acks]

        async def before():
            nc = await connect(cluster.url)
            try:
                js = nc.jetstream()
                await ensure_streams(js, StreamLimits(replicas=3))
                seqs = await publish(js, 0, 20)
                return seqs, (await js.stream_info(names.ROLLOUTS_STREAM)).cluster.leader
            finally:
                await nc.close()

        seqs, leader = asyncio.run(before())
        assert seqs == list(range(1, 21))
        cluster.nodes[int(leader.removeprefix("n"))].kill()

        async def after():
            nc = await connect(cluster.url)
            try:
                js = nc.jetstream()
                seqs = await publish(js, 20, 20)  # the first waits out the election of a new leader
                info = await js.stream_info(names.ROLLOUTS_STREAM)
                return seqs, info.state.messages, info.cluster.leader
            finally:
                await nc.close()

        seqs, stored, new_leader = asyncio.run(after())
        assert seqs == list(range(21, 41)) and stored == 40 and new_leader != leader


def test_a_publish_no_stream_answers_is_repeated_then_refused(tmp_path):
    async def publish(url):
        nc = await connect(url)
        try:
            await publish_acked(nc.jetstream(), "no.stream.here", b"m", what="probe", timeout=0.5, attempts=2)
        finally:
            await nc.close()

    with EmbeddedNats(tmp_path) as server, pytest.raises(PublishError) as refused:
        asyncio.run(publish(server.url))
    assert str(refused.value) == (
        "no stream answered probe on 'no.stream.here' for 1s: on a cluster, "
        "has the stream lost its leader with too few nodes left to elect one?"
    )


@pytest.mark.slow  # a row of the README's fault table: `-m slow` selects it
def test_a_consumer_fetches_through_the_loss_of_its_leader_and_nothing_is_delivered_twice(tmp_path):
    """Every message acked exactly once although the node leading the stream and the consumer
    is SIGKILLed halfway: fetches during the election return nothing instead of raising."""
    with NatsCluster(tmp_path, 3) as cluster:

        async def main():
            nc = await connect(cluster.url)
            try:
                js = nc.jetstream()
                await ensure_streams(js, StreamLimits(replicas=3))
                for i in range(30):
                    await publish_acked(js, names.PROMPTS_SUBJECT, f"{i}".encode(), {names.MSG_ID_HEADER: f"t{i}"})
                consumer = await pull_consumer(js, names.PROMPTS_STREAM, names.WORKERS_CONSUMER, ack_wait=30)
                seen, empty_fetches, killed = [], 0, None
                while len(seen) < 30:
                    msgs = await consumer.fetch(5, timeout=1.0)
                    empty_fetches += not msgs
                    assert empty_fetches < 60, f"stuck after {len(seen)} messages"
                    for msg in msgs:
                        await consumer.ack(msg)
                        seen.append(int(msg.data))
                    if killed is None and len(seen) >= 15:
                        info = await js.consumer_info(names.PROMPTS_STREAM, names.WORKERS_CONSUMER)
                        killed = info.cluster.leader
                        cluster.nodes[int(killed.removeprefix("n"))].kill()
                leftover = await consumer.fetch(5, timeout=1.0)
                return seen, leftover, killed
            finally:
                await nc.close()

        seen, leftover, killed = asyncio.run(main())
        assert sorted(seen) == list(range(30)) and leftover == [] and killed in {"n0", "n1", "n2"}

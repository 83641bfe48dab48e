"""NATS JetStream against a real nats-server: streams, publication, dedup, splitting, durability, work queue."""

import asyncio

import pytest
from nats.js.api import PubAck
from nats.js.errors import APIError

from centerline.nats_server import EmbeddedNats
from centerline.synth import make_batch
from rollout_worker.publish import HEADER_ROOM, publish_batch
from shared import names
from shared.contract import check_batch
from shared.nats_client import DUPLICATE_IN_PROCESS, connect, publish_acked, pull_consumer
from shared.streams import StreamConfigError, StreamLimits, ensure_streams
from shared.wire import decode_batch, encode_batch

VOCAB = 64
STREAMS = [
    names.PROMPTS_STREAM,
    names.ROLLOUTS_STREAM,
    names.DLQ_STREAM,
    names.WEIGHTS_STREAM,
    names.AUDIT_STREAM,
    names.ADVISORIES_STREAM,
]


def run(coro_fn, server: EmbeddedNats):
    """Run ``coro_fn(nc, js)`` on a fresh connection with the streams ensured."""

    async def main():
        nc = await connect(server.url)
        try:
            js = nc.jetstream()
            await ensure_streams(js)
            return await coro_fn(nc, js)
        finally:
            await nc.close()

    return asyncio.run(main())


@pytest.mark.integration
def test_a_published_batch_is_fetched_decoded_checked_and_acked_leaving_nothing_pending(nats_server):
    batch = make_batch(samples=4, tokens_per_sample=8, k=8, vocab_size=VOCAB, batch_id="b-1")

    async def body(nc, js):
        [ack] = await publish_batch(js, batch, max_payload=nc.max_payload)
        assert (ack.stream, ack.seq, ack.duplicate) == (names.ROLLOUTS_STREAM, 1, None)
        consumer = await pull_consumer(js, names.ROLLOUTS_STREAM, names.TRAINER_CONSUMER)
        [msg] = await consumer.fetch(1, timeout=5)
        assert msg.headers[names.MSG_ID_HEADER] == "b-1"
        got = decode_batch(msg.data)
        check_batch(got, vocab_size=VOCAB)
        assert msg.data == encode_batch(batch)
        await consumer.ack(msg)
        info = await js.consumer_info(names.ROLLOUTS_STREAM, names.TRAINER_CONSUMER)
        assert (info.num_pending, info.num_ack_pending, info.num_redelivered) == (0, 0, 0)
        assert await consumer.fetch(1, timeout=0.2) == []

    run(body, nats_server)


@pytest.mark.integration
def test_the_server_advertises_the_configured_max_payload(tmp_path):
    with EmbeddedNats(tmp_path, max_payload=3 << 20) as server:
        assert run(lambda nc, js: asyncio.sleep(0, nc.max_payload), server) == 3 << 20


@pytest.mark.integration
@pytest.mark.parametrize("crash", [False, True], ids=["sigterm", "sigkill"])
def test_acked_batches_survive_a_server_restart_byte_for_byte(nats_server, crash):
    batches = [
        make_batch(samples=2, tokens_per_sample=5, k=8, vocab_size=VOCAB, seed=i, batch_id=f"r-{i}") for i in range(5)
    ]

    async def publish(nc, js):
        await pull_consumer(js, names.ROLLOUTS_STREAM, names.TRAINER_CONSUMER)
        for b in batches:
            await publish_batch(js, b, max_payload=nc.max_payload)

    run(publish, nats_server)
    port = nats_server.port
    nats_server.kill() if crash else nats_server.stop()
    nats_server.start()
    assert nats_server.port == port

    async def fetch(nc, js):
        assert set((await ensure_streams(js)).values()) == {"unchanged"}  # the restarted deployment is the same
        consumer = await pull_consumer(js, names.ROLLOUTS_STREAM, names.TRAINER_CONSUMER)
        got = []
        while len(got) < len(batches) and (msgs := await consumer.fetch(len(batches), timeout=5)):
            for msg in msgs:
                got.append(msg.data)
                await consumer.ack(msg)
        return got

    assert run(fetch, nats_server) == [encode_batch(b) for b in batches]


@pytest.mark.integration
def test_a_publish_lost_in_a_server_restart_is_retried_and_stored_once(nats_server):
    async def main():
        nc = await connect(nats_server.url)
        try:
            js = nc.jetstream()
            await ensure_streams(js)
            await publish_batch(js, make_batch(batch_id="before"), max_payload=nc.max_payload)
            nats_server.stop()  # blocks the event loop: the client learns of it only when it next writes
            nats_server.start()
            [ack] = await publish_batch(js, make_batch(batch_id="after"), max_payload=nc.max_payload, timeout=1.0)
            return ack.seq, (await js.stream_info(names.ROLLOUTS_STREAM)).state.messages
        finally:
            await nc.close()

    assert asyncio.run(main()) == (2, 2)


@pytest.mark.integration
def test_the_same_batch_id_published_twice_is_stored_once_and_reported_duplicate(nats_server):
    batch = make_batch(samples=2, tokens_per_sample=4, k=8, vocab_size=VOCAB, batch_id="dup")

    async def body(nc, js):
        [first] = await publish_batch(js, batch, max_payload=nc.max_payload)
        [again] = await publish_batch(js, encode_batch(batch), max_payload=nc.max_payload, batch_id="dup")
        assert (first.seq, first.duplicate) == (1, None)
        assert (again.seq, again.duplicate) == (1, True)
        return (await js.stream_info(names.ROLLOUTS_STREAM)).state.messages

    assert run(body, nats_server) == 1


@pytest.mark.integration
def test_a_batch_over_max_payload_is_published_in_parts_and_a_republish_deduplicates_each(tmp_path):
    batch = make_batch(samples=6, tokens_per_sample=200, k=32, vocab_size=VOCAB, batch_id="big")
    max_payload = len(encode_batch(batch)) // 2
    with EmbeddedNats(tmp_path, max_payload=max_payload) as server:

        async def body(nc, js):
            assert nc.max_payload == max_payload
            acks = await publish_batch(js, batch, max_payload=nc.max_payload)
            again = await publish_batch(js, batch, max_payload=nc.max_payload)
            assert len(acks) >= 2 and all(a.duplicate for a in again)
            consumer = await pull_consumer(js, names.ROLLOUTS_STREAM, names.TRAINER_CONSUMER)
            msgs = await consumer.fetch(len(acks) + 1, timeout=2)
            for msg in msgs:
                await consumer.ack(msg)
            return [decode_batch(m.data) for m in msgs], [len(m.data) for m in msgs]

        parts, sizes = run(body, server)
    assert max(sizes) <= max_payload - HEADER_ROOM
    assert sum((p.sample_ids for p in parts), []) == batch.sample_ids


@pytest.mark.integration
def test_ensuring_the_streams_twice_changes_nothing(nats_server):
    async def body(nc, js):
        before = {n: await js.stream_info(n) for n in STREAMS}
        again = await ensure_streams(js)
        after = {n: await js.stream_info(n) for n in STREAMS}
        return before, again, after

    before, again, after = run(body, nats_server)
    assert again == {n: "unchanged" for n in STREAMS}
    for n in STREAMS:
        assert after[n].config == before[n].config
        assert after[n].created == before[n].created is not None


@pytest.mark.integration
def test_the_first_ensure_creates_every_stream_of_the_design(nats_server):
    async def body(nc, js):
        return {n: (await js.stream_info(n)).config for n in STREAMS}

    configs = run(body, nats_server)
    assert configs[names.PROMPTS_STREAM].retention == "workqueue"
    assert configs[names.ROLLOUTS_STREAM].subjects == [names.ROLLOUTS_SUBJECT]
    assert configs[names.ROLLOUTS_STREAM].storage == "file"
    assert configs[names.ROLLOUTS_STREAM].duplicate_window == StreamLimits().duplicate_window
    assert configs[names.WEIGHTS_STREAM].max_msgs_per_subject == 1
    assert configs[names.ADVISORIES_STREAM].subjects == list(names.ADVISORIES_SUBJECTS)
    assert {c.retention for n, c in configs.items() if n != names.PROMPTS_STREAM} == {"limits"}


@pytest.mark.integration
def test_a_changed_limit_updates_the_stream_in_place_keeping_its_messages(nats_server):
    async def body(nc, js):
        await publish_batch(js, make_batch(batch_id="keep"), max_payload=nc.max_payload)
        changed = await ensure_streams(js, StreamLimits(rollouts_max_age=3600.0, duplicate_window=60.0))
        info = await js.stream_info(names.ROLLOUTS_STREAM)
        return changed, info

    changed, info = run(body, nats_server)
    assert changed[names.ROLLOUTS_STREAM] == "updated" and changed[names.PROMPTS_STREAM] == "updated"
    assert (info.config.max_age, info.config.duplicate_window, info.state.messages) == (3600.0, 60.0, 1)


@pytest.mark.integration
def test_a_stream_with_another_retention_raises_naming_the_stream_and_field(nats_server):
    async def body(nc, js):
        await js.delete_stream(names.AUDIT_STREAM)
        await js.add_stream(
            name=names.AUDIT_STREAM, subjects=[names.AUDIT_SUBJECT], retention="workqueue", storage="file"
        )
        with pytest.raises(
            StreamConfigError, match=r"stream AUDIT: retention is 'workqueue', centerline wants 'limits'"
        ):
            await ensure_streams(js)

    run(body, nats_server)


@pytest.mark.integration
def test_the_weights_stream_keeps_only_the_last_update(nats_server):
    async def body(nc, js):
        for v in range(3):
            await js.publish(names.WEIGHTS_SUBJECT, b'{"version": %d}' % v)
        info = await js.stream_info(names.WEIGHTS_STREAM)
        last = await js.get_last_msg(names.WEIGHTS_STREAM, names.WEIGHTS_SUBJECT)
        return info.state.messages, last.data

    assert run(body, nats_server) == (1, b'{"version": 2}')


@pytest.mark.integration
def test_a_prompt_task_acked_is_removed_and_one_not_acked_is_redelivered_after_ack_wait(nats_server):
    async def body(nc, js):
        for task in (b"task-a", b"task-b"):
            await js.publish(names.PROMPTS_SUBJECT, task)
        worker = await pull_consumer(js, names.PROMPTS_STREAM, names.WORKERS_CONSUMER, ack_wait=1.0)
        first = await worker.fetch(2, timeout=5)
        assert sorted(m.data for m in first) == [b"task-a", b"task-b"]
        done = next(m for m in first if m.data == b"task-a")
        await worker.ack(done)
        # task-b was not acked: it comes back once ack_wait (1 s) has passed, not before.
        redelivered = []
        while not redelivered:
            redelivered = await worker.fetch(1, timeout=0.5)
        [again] = redelivered
        assert (again.data, again.metadata.num_delivered) == (b"task-b", 2)
        await worker.ack(again)
        assert await worker.fetch(1, timeout=1.5) == []
        return (await js.stream_info(names.PROMPTS_STREAM)).state.messages

    assert run(body, nats_server) == 0  # work queue: an acked task is deleted from the stream


def test_a_process_binding_the_consumer_with_another_ack_wait_sets_it_for_all_and_says_so(nats_server, caplog):
    """Every process that binds a durable consumer sets its ack_wait; the last one decides for
    all, so one bound earlier reads it back (``PullConsumer.ack_wait``) to pace its heartbeats."""

    async def body(nc, js):
        first = await pull_consumer(js, names.PROMPTS_STREAM, names.WORKERS_CONSUMER, ack_wait=60.0, shared=True)
        assert await first.ack_wait() == 60.0
        with caplog.at_level("WARNING", logger="centerline.nats"):
            await pull_consumer(js, names.PROMPTS_STREAM, names.WORKERS_CONSUMER, ack_wait=3.0, shared=True)
        return await first.ack_wait()

    assert run(body, nats_server) == 3.0
    assert [r.getMessage() for r in caplog.records] == [
        f"consumer {names.WORKERS_CONSUMER} on {names.PROMPTS_STREAM} had ack_wait 60s; this process sets 3s "
        "for every process bound to it (give them all the same --ack-wait)"
    ]


class ClusterStillStoring:
    """A JetStream cluster answering a repeated publish while its first copy is still being
    replicated: twice "duplicate message id is in process", then the PubAck of the copy stored."""

    def __init__(self):
        self.calls = 0

    async def publish(self, subject, data, timeout=None, headers=None):
        self.calls += 1
        if self.calls <= 2:
            raise APIError(code=409, err_code=DUPLICATE_IN_PROCESS, description="duplicate message id is in process")
        return PubAck(stream=names.PROMPTS_STREAM, seq=7, duplicate=True)


def test_a_publish_a_cluster_is_still_storing_is_repeated_until_it_is_acked_as_a_duplicate():
    js = ClusterStillStoring()
    ack = asyncio.run(publish_acked(js, names.PROMPTS_SUBJECT, b"{}", {names.MSG_ID_HEADER: "r/0/0"}, what="task"))
    assert (ack.seq, ack.duplicate, js.calls) == (7, True, 3)

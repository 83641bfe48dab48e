"""The streams' byte caps against a real nats-server (docs/design.md section 3): a full ROLLOUTS refuses
a batch by name and drops none, a ROLLOUTS of an earlier release (discarding old batches) is changed in
place, caps that do not fit the server's ``max_file_store`` are refused naming the fix, and the trainer's
trim purges only what its consumer acked."""

from __future__ import annotations

import asyncio

import pytest
from nats.js.api import DiscardPolicy, StreamConfig

from centerline.nats_server import EmbeddedNats
from shared import names
from shared.nats_client import StoreFull, connect, publish_acked, pull_consumer
from shared.streams import StreamConfigError, StreamLimits, ensure_streams
from trainer_service import store

pytestmark = pytest.mark.integration

CAP = 40_000
BATCH = bytes(9_000)  # four fit under CAP, a fifth does not


def on_server(tmp_path, body, **server):
    async def main():
        with EmbeddedNats(tmp_path / "nats", **server) as nats:
            nc = await connect(nats.url)
            try:
                return await body(nc.jetstream())
            finally:
                await nc.close()

    return asyncio.run(asyncio.wait_for(main(), 60))


async def publish(js, i: int):
    return await publish_acked(js, names.ROLLOUTS_SUBJECT, BATCH, {names.MSG_ID_HEADER: f"b{i}"}, what=f"batch b{i}")


def test_a_full_rollouts_refuses_a_batch_by_name_and_drops_none(tmp_path):
    async def body(js):
        await ensure_streams(js, StreamLimits(rollouts_max_bytes=CAP))
        for i in range(4):
            await publish(js, i)
        with pytest.raises(StoreFull) as refused:
            await publish(js, 4)
        return refused.value, (await js.stream_info(names.ROLLOUTS_STREAM)).state

    refused, state = on_server(tmp_path, body)
    assert (state.first_seq, state.messages) == (1, 4)  # the oldest, untrained, kept
    assert str(refused) == (
        "batch b4 not stored: the stream of 'rollouts.batches' is at its byte cap (JetStream: maximum bytes "
        "exceeded); ROLLOUTS refuses new batches while batches not yet trained fill it, and the trainer frees it "
        "as it trains (docs/design.md section 3): raise --rollouts-max-bytes if it stays full"
    )
    assert refused.rule == "store_full" and refused.description == "maximum bytes exceeded"


def test_a_rollouts_that_discards_old_batches_is_changed_in_place_by_the_trainer_keeping_them(tmp_path):
    async def body(js):
        old = StreamConfig(
            name=names.ROLLOUTS_STREAM,
            subjects=[names.ROLLOUTS_SUBJECT],
            storage="file",
            discard=DiscardPolicy.OLD,
            max_age=7 * 86400.0,
            max_bytes=CAP,
            duplicate_window=600.0,
        )
        await js.add_stream(old)
        await publish(js, 0)
        worker = await ensure_streams(js)  # a worker, the proxy: no caps of their own, and no update rights
        outcome = await ensure_streams(js, StreamLimits(rollouts_max_bytes=CAP))  # the trainer
        return worker, outcome, await js.stream_info(names.ROLLOUTS_STREAM)

    worker, outcome, info = on_server(tmp_path, body)
    assert worker[names.ROLLOUTS_STREAM] == "unchanged" and outcome[names.ROLLOUTS_STREAM] == "updated"
    assert (info.config.discard, info.state.messages) == (DiscardPolicy.NEW, 1)


def test_caps_the_servers_store_cannot_reserve_are_refused_naming_the_fix(tmp_path):
    async def body(js):
        with pytest.raises(StreamConfigError) as refused:
            await ensure_streams(js, StreamLimits(rollouts_max_bytes=2 << 20, audit_max_bytes=64 << 10))
        return str(refused.value)

    message = on_server(tmp_path, body, max_file_store=1 << 20)
    assert message == (
        "stream ROLLOUTS: max_bytes=2097152, but the NATS server's store has no room left to reserve it (JetStream: "
        "insufficient storage resources available): every capped stream's max_bytes is reserved in the server's "
        "max_file_store (jetstream block). Raise max_file_store, or lower the caps: --rollouts-max-bytes, "
        "--dlq-max-bytes, --store-retention-steps"
    )


def test_the_trim_purges_only_what_the_trainer_consumer_acked(tmp_path):
    async def body(js):
        await ensure_streams(js, StreamLimits(rollouts_max_bytes=CAP))
        consumer = await pull_consumer(
            js, names.ROLLOUTS_STREAM, names.TRAINER_CONSUMER, filter_subject=names.ROLLOUTS_SUBJECT
        )
        for i in range(4):
            await publish(js, i)
        msgs = await consumer.fetch(3, timeout=5.0)
        for m in (msgs[0], msgs[2]):  # b0 and b2 trained; b1 held, b3 not fetched yet
            await consumer.ack(m)
        gone = await store.trim(js, CAP, room=CAP)  # room for everything: every settled message may go
        state = (await js.stream_info(names.ROLLOUTS_STREAM)).state
        none = await store.trim(js, CAP, room=0)  # under the cap less no room: nothing to do
        return gone, state, none

    gone, state, none = on_server(tmp_path, body)
    assert gone == 1 and (state.first_seq, state.messages) == (2, 3)  # b0 only: b1 is unsettled
    assert none == 0

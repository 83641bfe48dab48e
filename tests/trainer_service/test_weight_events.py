"""The ``weights.updated`` event: announced after the engines loaded a version, off the step's
path (its digest in a thread, its PubAck not awaited by the next step), each event after the one
before, and every one sent by the time the publisher is closed."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time

import orjson
import pytest

from centerline.nats_server import EmbeddedNats
from shared import names
from shared.nats_client import connect
from shared.streams import ensure_streams
from trainer_service.weights import WeightPublisher, version_dir

pytestmark = pytest.mark.integration


def test_events_follow_one_another_and_a_pruned_version_is_skipped_with_a_warning(tmp_path, caplog):
    root = tmp_path / "weights"
    for version in (1, 2, 3, 4):
        version_dir(root, version).mkdir(parents=True)
        (version_dir(root, version) / "model.safetensors").write_bytes(bytes([version]) * 1000)

    async def scenario():
        nc = await connect(nats.url)
        js = nc.jetstream()
        await ensure_streams(js)
        publisher = WeightPublisher(js, [])  # no engine: only the announcements
        try:
            for version in (1, 2, 3):
                await publisher.publish(version, version_dir(root, version))
            pruned = version_dir(root, 4)
            await publisher.publish(4, pruned)
            for f in pruned.iterdir():  # gone before its digest is taken (the events before it go first)
                f.unlink()
            pruned.rmdir()
        finally:
            await publisher.close()
        info = await js.stream_info(names.WEIGHTS_STREAM)
        last = orjson.loads((await js.get_last_msg(names.WEIGHTS_STREAM, names.WEIGHTS_SUBJECT)).data)
        await nc.close()
        return info.state.last_seq, last

    with EmbeddedNats(tmp_path / "nats") as nats, caplog.at_level(logging.WARNING, "centerline.trainer.weights"):
        published, last = asyncio.run(scenario())
    assert published == 3  # versions 1, 2, 3 in order; 4 pruned before it was announced
    assert (last["version"], last["path"]) == (3, str(version_dir(root, 3).resolve()))
    assert last["sha256"] == hashlib.sha256(bytes([3]) * 1000).hexdigest()
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["weights version 4 is loaded but not announced"]


def test_closing_with_nats_gone_waits_for_the_last_event_only_the_grace(tmp_path, caplog):
    root = tmp_path / "weights"
    version_dir(root, 1).mkdir(parents=True)
    (version_dir(root, 1) / "model.safetensors").write_bytes(b"w")

    async def scenario():
        nc = await connect(nats.url)
        try:
            js = nc.jetstream()
            await ensure_streams(js)
            publisher = WeightPublisher(js, [])
            nats.kill()  # gone before the event goes out: its publish would retry for 30 s
            await publisher.publish(1, version_dir(root, 1))
            started = time.monotonic()
            await publisher.close(grace=0.5)
            return time.monotonic() - started, publisher.announcing.cancelled()
        finally:
            # ends the client's reconnecting, which an unclosed client keeps up forever; nats-py
            # re-raises the reset of the connection it was retrying
            with contextlib.suppress(ConnectionResetError):
                await nc.close()

    with EmbeddedNats(tmp_path / "nats") as nats, caplog.at_level(logging.WARNING, "centerline.trainer.weights"):
        took, cancelled = asyncio.run(scenario())
    assert cancelled and took < 5, took
    assert "the last weights version was not announced within 0.5s of stopping (NATS down?)" in caplog.messages

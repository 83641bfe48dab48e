"""Audit events reach the AUDIT stream on audit.proxy through the embedded NATS server."""

import asyncio
import json
import urllib.error
import urllib.request

import pytest
from nats.js.errors import NotFoundError

from centerline.nats_server import EmbeddedNats
from shared import names
from shared.nats_client import connect

pytestmark = pytest.mark.integration


def post(url: str, body: dict) -> int:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


async def audit_messages(url: str) -> list[dict]:
    nc = await connect(url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(names.AUDIT_STREAM)
        sub = await js.subscribe(names.AUDIT_SUBJECT, ordered_consumer=True)
        events = [json.loads((await sub.next_msg(timeout=5)).data) for _ in range(info.state.messages)]
        return events
    finally:
        await nc.close()


def test_audit_events_reach_nats(tmp_path, start, kinds):
    server = EmbeddedNats(tmp_path / "nats").start()
    try:
        double = start(kinds.Double, "--truncate", "20")
        proxy = start(kinds.ProxyProcess, double.url, "--rollout-top-logprobs-num", "128", "--nats-url", server.url)
        assert post(proxy.url + "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2}}) == 502

        def stored():
            try:
                events = asyncio.run(audit_messages(server.url))
            except NotFoundError:  # the proxy has not created the AUDIT stream yet
                return None
            return events if any(e["path"] == "/generate" for e in events) else None

        events = kinds.wait_until(stored, 30, "audit event in the AUDIT stream")
        event = [e for e in events if e["path"] == "/generate"][0]
        assert (
            event["verdict"],
            event["action"],
            event["error"]["rule"],
            event["error"]["expected"],
            event["error"]["found"],
        ) == ("fail", "blocked", "short_row", 128, 20)
    finally:
        server.stop()

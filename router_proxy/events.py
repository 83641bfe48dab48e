"""Audit events and metrics of the proxy: one NATS event and one Prometheus count per audited request.

The NATS side never stalls a request: ``AuditPublisher.emit`` only puts the event on a bounded
queue; a background task connects (with reconnects), publishes on ``audit.proxy`` (captured
by the AUDIT stream) and drops the oldest work when NATS is slower than the traffic,
counting what it dropped.
"""

from __future__ import annotations

import asyncio
import logging

import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shared import names

log = logging.getLogger("centerline.proxy")

# Added latency (proxy time minus upstream time) sits around 0.1-1 ms; audits of long responses reach tens of ms.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class ProxyMetrics:
    """The proxy's Prometheus series, in their own registry (one proxy per process, several per test)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("centerline_proxy_requests", "Requests by endpoint and kind (training, eval, rejected)", ["endpoint", "kind"], registry=self.registry)
        self.verdicts = Counter("centerline_proxy_audit_verdicts", "Audited training responses by verdict: ok or the rule broken", ["verdict"], registry=self.registry)
        self.added_latency = Histogram("centerline_proxy_added_latency_seconds", "Time spent in the proxy per training request, upstream time excluded", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.ready = Gauge("centerline_proxy_ready", "1 when the last capability probe found the upstream compatible", registry=self.registry)
        self.events_dropped = Counter("centerline_proxy_audit_events_dropped", "Audit events not published because NATS lagged or was down", registry=self.registry)


class AuditPublisher:
    """Publishes audit events to NATS from a background task; ``emit`` never waits."""

    def __init__(self, url: str | None, metrics: ProxyMetrics, *, queue_size: int = 10_000):
        self.url = url
        self.metrics = metrics
        self.queue: asyncio.Queue[dict] = asyncio.Queue(queue_size)
        self.task: asyncio.Task | None = None
        self.nc = None

    def start(self) -> None:
        if self.url:
            self.task = asyncio.create_task(self._run(), name="audit-publisher")

    def emit(self, event: dict) -> None:
        if self.task is None:
            return
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:
            self.metrics.events_dropped.inc()

    async def _run(self) -> None:
        from shared.nats import connect, ensure_streams  # nats-py only when events are on

        while self.nc is None:
            try:
                self.nc = await connect(self.url, name="router_proxy", connect_timeout=2)
            except Exception as exc:  # keep serving; events queue (and drop when full) until NATS is there
                log.warning("audit events: NATS at %s unavailable (%s); retrying", self.url, exc)
                await asyncio.sleep(2.0)
        try:
            await ensure_streams(self.nc.jetstream())
        except Exception as exc:  # publishing still reaches the AUDIT stream if someone else made it
            log.warning("audit events: could not ensure the AUDIT stream: %s", exc)
        while True:
            event = await self.queue.get()
            try:
                await self.nc.publish(names.AUDIT_SUBJECT, orjson.dumps(event))
            except Exception as exc:
                self.metrics.events_dropped.inc()
                log.warning("audit event not published: %s", exc)

    async def stop(self) -> None:
        if self.task is None:
            return
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        if self.nc is not None and self.nc.is_connected:  # hand what is queued to NATS before closing
            while not self.queue.empty():
                await self.nc.publish(names.AUDIT_SUBJECT, orjson.dumps(self.queue.get_nowait()))
            await self.nc.drain()

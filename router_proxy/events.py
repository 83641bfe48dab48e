"""Audit events and metrics of the proxy: one NATS event and one Prometheus count per audited request.

The NATS side never stalls a request: ``AuditPublisher.enqueue`` only puts the event on a bounded
queue; a background task connects (with reconnects), publishes on ``audit.proxy`` (captured
by the AUDIT stream) and drops the oldest work when NATS is slower than the traffic,
counting what it dropped.
"""

from __future__ import annotations

import asyncio
import logging

import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from shared import names

log = logging.getLogger("centerline.proxy")

# Added latency (proxy time minus upstream time) sits around 0.1-1 ms; audits of long responses reach tens of ms.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class ProxyMetrics:
    """The proxy's Prometheus series, in their own registry (one proxy per process, several per test)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "centerline_proxy_requests",
            "Requests by endpoint and kind (training, eval, rejected)",
            ["endpoint", "kind"],
            registry=self.registry,
        )
        self.verdicts = Counter(
            "centerline_proxy_audit_verdicts",
            "Audited training responses by verdict: ok or the rule broken",
            ["verdict"],
            registry=self.registry,
        )
        self.added_latency = Histogram(
            "centerline_proxy_added_latency_seconds",
            "Time spent in the proxy per training request, upstream time excluded",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ready = Gauge(
            "centerline_proxy_ready",
            "1 when the last capability probe found the upstream compatible",
            registry=self.registry,
        )
        self.events_dropped = Counter(
            "centerline_proxy_audit_events_dropped",
            "Audit events not published because NATS lagged or was down",
            registry=self.registry,
        )
        self._counts: dict = {}  # (family, labels) -> increments not yet applied
        self._added: list[float] = []  # latencies not yet observed

    # Counting and observing happen on every request; prometheus_client costs ~2 us a request
    # for them (labels() lookups, a lock per call). They are buffered here, and applied in one
    # go when /metrics is scraped (``flush``) or the buffer is long.

    def count(self, family: Counter, *labels: str) -> None:
        key = (family, labels)
        self._counts[key] = self._counts.get(key, 0) + 1

    def observe_added(self, seconds: float) -> None:
        self._added.append(seconds)
        if len(self._added) >= 4096:
            self.flush()

    def flush(self) -> None:
        counts, self._counts = self._counts, {}
        for (family, labels), n in counts.items():
            family.labels(*labels).inc(n)
        added, self._added = self._added, []
        for seconds in added:
            self.added_latency.observe(seconds)

    def exposition(self) -> bytes:
        """The Prometheus text format, buffered observations included."""
        self.flush()
        return generate_latest(self.registry)


class AuditPublisher:
    """Publishes audit events to NATS from a background task; ``enqueue`` never waits."""

    def __init__(self, url: str | None, metrics: ProxyMetrics, *, queue_size: int = 10_000):
        self.url = url
        self.metrics = metrics
        self.queue: asyncio.Queue[dict] = asyncio.Queue(queue_size)
        self.task: asyncio.Task | None = None
        self.nc = None

    def start(self) -> None:
        if self.url:
            self.task = asyncio.create_task(self._run(), name="audit-publisher")

    @property
    def enabled(self) -> bool:
        """False without NATS: callers then skip building the event at all."""
        return self.task is not None

    def enqueue(self, event: dict) -> None:
        if self.task is None:
            return
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:
            self.metrics.events_dropped.inc()

    async def _run(self) -> None:
        from shared.nats_client import connect  # nats-py only when events are on
        from shared.streams import ensure_streams

        while self.nc is None:
            try:
                self.nc = await connect(self.url, name="router_proxy", connect_timeout=2)
            # keep serving; events queue (and drop when full) until NATS is there
            except Exception as exc:  # noqa: BLE001
                log.warning("audit events: NATS at %s unavailable (%s); retrying", self.url, exc)
                await asyncio.sleep(2.0)
        try:
            await ensure_streams(self.nc.jetstream())
        # publishing still reaches the AUDIT stream if someone else made it
        except Exception as exc:  # noqa: BLE001
            log.warning("audit events: could not ensure the AUDIT stream: %s", exc)
        while True:
            events = [await self.queue.get()]
            while not self.queue.empty():  # drain what queued meanwhile in one wake-up: one task switch per burst
                events.append(self.queue.get_nowait())
            for event in events:
                try:
                    await self.nc.publish(names.AUDIT_SUBJECT, orjson.dumps(event))
                except Exception as exc:  # noqa: BLE001 (an event lost is counted, never a request)
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

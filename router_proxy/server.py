"""The router proxy (DESIGN section 7): the candidate contract enforced between rollouts and SGLang.

    centerline proxy --upstream http://127.0.0.1:30001 --port 30010 [--vocab-size V] [config flags]

- POST /generate and /v1/chat/completions: training requests are rewritten to the contract
  (``rewrite.py``), forwarded, and their responses audited (``audit.py``) before anyone sees
  them; ``enforce`` turns a defect into 502 ``{"error": {rule, message, row, expected, found}}``,
  ``observe`` passes it with an ``X-Centerline-Audit`` header. ``X-Centerline-Eval: 1`` requests
  pass through untouched.
- GET /ready is 503 until the capability probe (``probe.py``) passes; GET /capabilities runs
  it again. GET /metrics is Prometheus. Engine admin endpoints answer 403.

Upstream connections: one aiohttp ``ClientSession`` over a ``TCPConnector`` keep-alive pool,
not httpx (a shared ``httpx.AsyncClient`` served 447 req/s at concurrency 32 against an
upstream doing ~8,000; encode/httpx#3215). ``centerline bench proxy`` measures the result.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
import time

import aiohttp
import orjson
from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router_proxy.audit import audit_body
from router_proxy.events import AuditPublisher, ProxyMetrics
from router_proxy.probe import ProbeReport, learn_vocab_size, probe
from router_proxy.rewrite import Contract, RequestRejected, rewrite_body
from shared.config import ENV_PREFIX, ConfigError, add_arguments, load_toml, resolve
from shared.contract import ContractViolation

log = logging.getLogger("centerline.proxy")

EVAL_HEADER = "x-centerline-eval"
AUDIT_HEADER = "X-Centerline-Audit"
JSON = "application/json"
FORWARDED_HEADERS = ("authorization", "x-request-id")
TRAINING_PATHS = {"/generate": "generate", "/v1/chat/completions": "chat"}
# Read-only upstream paths the proxy forwards as they are.
PASS_THROUGH = ("/health", "/health_generate", "/get_model_info", "/model_info", "/get_server_info", "/server_info", "/v1/models")
# Engine and router administration: never reachable through the proxy (the trainer calls engines directly).
ADMIN_PREFIXES = (
    "/update_weight", "/init_weights_update_group", "/destroy_weights_update_group", "/begin_weight_update",
    "/end_weight_update", "/get_weight_version", "/flush_cache", "/pause_generation", "/continue_generation",
    "/release_memory_occupation", "/resume_memory_occupation", "/abort_request", "/shutdown", "/workers",
    "/add_worker", "/remove_worker", "/list_workers", "/start_profile", "/stop_profile", "/configure_logging",
    "/set_internal_state", "/load_lora_adapter", "/unload_lora_adapter", "/slow_down", "/open_session", "/close_session",
)  # fmt: skip


class Proxy:
    """State shared by the routes: contract, upstream pool, readiness, metrics and audit events."""

    def __init__(self, upstream: str, contract: Contract, *, audit_mode: str = "enforce", vocab_size: int | None = None,
                 nats_url: str | None = None, upstream_timeout: float = 1800.0, max_connections: int = 512):  # fmt: skip
        self.upstream = upstream.rstrip("/")
        self.contract = contract
        self.audit_mode = audit_mode
        self.vocab_flag = vocab_size
        self.vocab_size = vocab_size
        self.upstream_timeout = upstream_timeout
        self.max_connections = max_connections
        self.metrics = ProxyMetrics()
        self.publisher = AuditPublisher(nats_url, self.metrics)
        self.report: ProbeReport | None = None
        self.session: aiohttp.ClientSession | None = None
        self.prober: asyncio.Task | None = None

    @property
    def ready(self) -> bool:
        return self.report is not None and self.report.compatible

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=self.max_connections, keepalive_timeout=60, ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=self.upstream_timeout, sock_connect=10), auto_decompress=False
        )
        self.publisher.start()
        self.prober = asyncio.create_task(self._probe_until_ready(), name="capability-probe")

    async def stop(self) -> None:
        if self.prober is not None:
            self.prober.cancel()
        await self.publisher.stop()
        await self.session.close()

    async def run_probe(self) -> ProbeReport:
        report = await probe(self.session, self.upstream, self.contract, vocab_size=self.vocab_flag)
        if report.vocab_size:
            self.vocab_size = report.vocab_size
        if report.compatible != self.ready or (self.report and report.cause != self.report.cause) or self.report is None:
            if report.compatible:
                log.warning("upstream %s is compatible with the contract (%s, %s, K=%d): ready", self.upstream, self.contract.endpoint, self.contract.mode, self.contract.k)
            else:
                log.warning("upstream %s is NOT compatible, proxy not ready: %s", self.upstream, report.cause)
        self.report = report
        self.metrics.ready.set(1 if report.compatible else 0)
        return report

    async def _probe_until_ready(self) -> None:
        delay = 0.25
        while not (await self.run_probe()).compatible:
            await asyncio.sleep(delay)  # retry: a router may still be registering its workers
            delay = min(delay * 2, 10.0)

    async def forward(self, method: str, path: str, body: bytes | None, headers) -> tuple[int, bytes, str]:
        sent = {"Content-Type": headers.get("content-type", JSON)}
        sent.update({h: headers[h] for h in FORWARDED_HEADERS if h in headers})
        async with self.session.request(method, self.upstream + path, data=body, headers=sent) as resp:
            return resp.status, await resp.read(), resp.headers.get("Content-Type", JSON)

    async def training(self, endpoint: str, path: str, raw: bytes, headers: dict) -> tuple[int, bytes, str, dict]:
        """One training (or eval) request: ``(status, body, content type, extra headers)`` for the client."""
        if headers.get(EVAL_HEADER) == "1":
            self.metrics.requests.labels(endpoint, "eval").inc()
            try:
                return (*await self.forward("POST", path, raw, headers), {})
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                return _error(502, ContractViolation("upstream_unreachable", f"{self.upstream}{path}: {exc!r}"))
        started = time.perf_counter()
        try:
            sent = rewrite_body(raw, endpoint, self.contract)
        except RequestRejected as exc:
            self.metrics.requests.labels(endpoint, "rejected").inc()
            return 400, orjson.dumps(exc.to_dict()), JSON, {}
        self.metrics.requests.labels(endpoint, "training").inc()
        if self.vocab_size is None:
            self.vocab_size = await learn_vocab_size(self.session, self.upstream)
        sent_at = time.perf_counter()
        status, body, ctype = 0, b"", JSON
        violation, result = None, None
        try:
            status, body, ctype = await self.forward("POST", path, sent, headers)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            violation = ContractViolation("upstream_unreachable", f"{self.upstream}{path}: {exc!r}")
        upstream_s = time.perf_counter() - sent_at
        if violation is None:
            violation, result = self._audit(endpoint, status, body)
        added_s = time.perf_counter() - started - upstream_s
        self.metrics.added_latency.observe(added_s)
        self.metrics.verdicts.labels(violation.rule if violation else "ok").inc()
        blocked = violation is not None and self.audit_mode == "enforce"
        self.publisher.emit({
            "ts": time.time(), "path": path, "mode": self.contract.mode, "k": self.contract.k, "audit_mode": self.audit_mode,
            "verdict": "fail" if violation else "ok", "action": "blocked" if blocked else "passed",
            "error": violation.to_dict() if violation else None, "upstream_status": status,
            "samples": result.samples if result else None, "tokens": result.tokens if result else None,
            "upstream_ms": upstream_s * 1e3, "added_ms": added_s * 1e3,
        })  # fmt: skip
        if blocked:
            return _error(502, violation)
        verdict = "ok" if violation is None else _verdict(violation)
        if status == 0:  # observe mode and no upstream answer: nothing to pass on
            return _error(502, violation, {AUDIT_HEADER: verdict})
        return status, body, ctype, {AUDIT_HEADER: verdict}

    def _audit(self, endpoint: str, status: int, body: bytes):
        if status != 200:
            text = body[:300].decode(errors="replace")
            return ContractViolation("upstream_status", f"the upstream answered {status}: {text}", expected=200, found=status), None
        if self.vocab_size is None:
            return ContractViolation("vocab_unknown", "the upstream reports no vocab_size; start the proxy with --vocab-size"), None
        try:
            return None, audit_body(body, endpoint=endpoint, mode=self.contract.mode, k=self.contract.k, vocab_size=self.vocab_size)
        except ContractViolation as exc:
            return exc, None
        except Exception as exc:  # a shape no check anticipated is still a malformed response, never a 500
            log.exception("audit failed on an unexpected response shape")
            return ContractViolation("malformed_response", f"the response could not be audited ({type(exc).__name__}: {exc})"), None


def _verdict(v: ContractViolation) -> str:
    parts = [f"fail; rule={v.rule}"] + [f"{name}={value}" for name, value in (("sample", v.sample), ("row", v.row), ("expected", v.expected), ("found", v.found)) if value is not None]
    return "; ".join(parts)


def _error(status: int, v: ContractViolation, headers: dict | None = None) -> tuple[int, bytes, str, dict]:
    return status, orjson.dumps({"error": v.to_dict()}), JSON, headers or {}


class TrainingFront:
    """ASGI front: POST /generate and /v1/chat/completions served without FastAPI's per-request
    machinery (measured: FastAPI routing alone capped the proxy well below the bench targets);
    everything else, lifespan included, goes to the FastAPI app."""

    def __init__(self, proxy: Proxy, app: FastAPI):
        self.proxy, self.app = proxy, app

    async def __call__(self, scope, receive, send):
        endpoint = TRAINING_PATHS.get(scope.get("path")) if scope["type"] == "http" and scope["method"] == "POST" else None
        if endpoint is None:
            return await self.app(scope, receive, send)
        raw, more = b"", True
        while more:
            message = await receive()
            raw += message.get("body", b"")
            more = message.get("more_body", False)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        status, body, ctype, extra = await self.proxy.training(endpoint, scope["path"], raw, headers)
        out = [(b"content-type", ctype.encode()), (b"content-length", str(len(body)).encode())]
        out += [(k.lower().encode(), v.encode()) for k, v in extra.items()]
        await send({"type": "http.response.start", "status": status, "headers": out})
        await send({"type": "http.response.body", "body": body})


def build_app(proxy: Proxy) -> TrainingFront:
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await proxy.start()
        yield
        await proxy.stop()

    app = FastAPI(title="centerline router proxy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/ready")
    async def ready() -> Response:
        report = proxy.report
        body = {"ready": proxy.ready, "cause": report.cause if report else "capability probe not finished", "upstream": proxy.upstream}
        return Response(orjson.dumps(body), 200 if proxy.ready else 503, media_type=JSON)

    @app.get("/capabilities")
    async def capabilities() -> Response:
        return Response(orjson.dumps((await proxy.run_probe()).to_dict()), 200, media_type=JSON)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(proxy.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/liveness")
    async def liveness() -> Response:
        return Response(b'{"status":"ok"}', media_type=JSON)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def other(path: str, request: Request) -> Response:
        path = "/" + path
        if path.startswith(ADMIN_PREFIXES):
            body = {"error": {"rule": "admin_forbidden", "message": f"{path} is an engine admin endpoint and is not reachable through the proxy; call each engine directly"}}
            return Response(orjson.dumps(body), 403, media_type=JSON)
        if path in PASS_THROUGH and request.method == "GET":
            try:
                status, body, ctype = await proxy.forward("GET", path, None, request.headers)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                status, body, ctype, _ = _error(502, ContractViolation("upstream_unreachable", f"{proxy.upstream}{path}: {exc!r}"))
            return Response(body, status, media_type=ctype)
        return Response(orjson.dumps({"error": {"rule": "not_found", "message": f"{request.method} {path} is not served by the proxy"}}), 404, media_type=JSON)

    return TrainingFront(proxy, app)


def main(argv: list[str]) -> int:
    """`centerline proxy`: serve the contract-enforcing proxy in front of an SGLang router or server."""
    parser = argparse.ArgumentParser(prog="centerline proxy", description=main.__doc__)
    parser.add_argument("--upstream", required=True, help="SGLang router or server URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30010)
    parser.add_argument("--vocab-size", type=int, default=None, help="used when the upstream's /model_info reports none")
    parser.add_argument("--upstream-timeout", type=float, default=1800.0, help="seconds per upstream request")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        cfg = resolve(args)
    except ConfigError as exc:
        print(f"centerline proxy: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    nats_url = cfg.nats_url if _nats_configured(args) else None
    proxy = Proxy(args.upstream, Contract.from_config(cfg), audit_mode=cfg.proxy_audit_mode, vocab_size=args.vocab_size,
                  nats_url=nats_url, upstream_timeout=args.upstream_timeout)  # fmt: skip
    import uvicorn

    config = uvicorn.Config(build_app(proxy), host=args.host, port=args.port, loop="uvloop", http="httptools",
                            log_level="warning", access_log=False, lifespan="on", proxy_headers=False, server_header=False,
                            date_header=False)  # fmt: skip
    log.warning("proxy on http://%s:%d -> %s (%s)", args.host, args.port, proxy.upstream, proxy.contract)
    uvicorn.Server(config).run()
    return 0


def _nats_configured(args: argparse.Namespace) -> bool:
    """Audit events go to NATS only when a URL was given (flag, TOML or environment), not by default."""
    if "nats_url" in vars(args) or ENV_PREFIX + "NATS_URL" in os.environ:
        return True
    return "config" in vars(args) and "nats_url" in load_toml(args.config)




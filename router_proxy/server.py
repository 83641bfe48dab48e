"""The router proxy (docs/design.md section 7): the candidate contract enforced between rollouts and SGLang.
Its routes and their state are here; the command, ``centerline proxy``, is ``router_proxy/main.py``.

- POST /generate and /v1/chat/completions: training requests are rewritten to the contract
  (``rewrite.py``), forwarded, and their responses audited (``audit.py``) before anyone sees
  them; ``enforce`` turns a defect into 502 ``{"error": {rule, message, row, expected, found}}``,
  ``observe`` passes it with an ``X-Centerline-Audit`` header. ``X-Centerline-Eval: 1`` requests
  pass through untouched (their K is still bounded by ``--max-top-logprobs-num``).
- A training request with ``Accept: application/x-centerline-arrays`` (the rollout worker's)
  gets a passed response as the arrays the audit checked (``shared/response_arrays.py``,
  that content type) instead of SGLang's JSON, so the response is parsed once; every other
  client gets SGLang's bytes unchanged, and errors are the same JSON for both.
- Limits: a request body above ``--max-request-body-bytes`` is 413; an upstream answer above
  ``--max-upstream-response-bytes`` is cut off and becomes 502 ``upstream_too_large``.
- GET /ready is 503 until the capability probe (``probe.py``) passes; GET /capabilities runs
  it again. GET /metrics is Prometheus. Engine admin endpoints answer 403, and a client's
  ``Authorization`` header is never forwarded (the trainer alone holds the engines' admin key
  and calls each engine directly). An upstream started with ``--api-key`` gets the proxy's own
  key instead, from ``CENTERLINE_UPSTREAM_API_KEY`` or ``CENTERLINE_UPSTREAM_API_KEY_FILE``
  (``upstream.py``), on every request.

The HTTP on both sides is lean on purpose (``front.py`` serves, ``upstream.py`` pools
keep-alive connections to the upstream): FastAPI/uvicorn and aiohttp cost more CPU per request
than the audit itself. ``centerline bench proxy`` measures the result.
"""

from __future__ import annotations

import asyncio
import logging
import time

import orjson
from prometheus_client import CONTENT_TYPE_LATEST

from router_proxy import answer
from router_proxy.audit import audit_body
from router_proxy.events import AuditPublisher, ProxyMetrics
from router_proxy.front import Reply, Request
from router_proxy.probe import ProbeReport, learn_vocab_size, probe
from router_proxy.rewrite import Contract, RequestRejected, check_eval_body, rewrite_request
from router_proxy.upstream import UpstreamPool, UpstreamTooLarge
from shared import response_arrays
from shared.config import Config
from shared.contract import ContractViolation, k_above_vocab
from shared.settings import ProxySettings

log = logging.getLogger("centerline.proxy")

EVAL_HEADER = b"x-centerline-eval"
AUDIT_HEADER = b"x-centerline-audit"
JSON = b"application/json"
ARRAYS = response_arrays.MEDIA_TYPE.encode()
# x-smg-routing-key: a session's key, which keeps its turns on one engine behind smg. Never authorization:
# see the module docstring.
FORWARDED_HEADERS = (b"x-request-id", b"x-smg-routing-key")
TRAINING_PATHS = {b"/generate": "generate", b"/v1/chat/completions": "chat"}
# Read-only upstream paths the proxy forwards as they are.
PASS_THROUGH = {b"/health", b"/health_generate", b"/v1/models"}
MODEL_INFO = {b"/get_model_info", b"/model_info"}  # forwarded, with the learned vocab_size added
# Engine and router administration: never reachable through the proxy (the trainer calls engines directly).
ADMIN_PREFIXES = (
    "/update_weight",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/begin_weight_update",
    "/end_weight_update",
    "/get_weight_version",
    "/flush_cache",
    "/pause_generation",
    "/continue_generation",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/abort_request",
    "/shutdown",
    "/workers",
    "/add_worker",
    "/remove_worker",
    "/list_workers",
    "/start_profile",
    "/stop_profile",
    "/configure_logging",
    "/set_internal_state",
    "/load_lora_adapter",
    "/unload_lora_adapter",
    "/slow_down",
    "/open_session",
    "/close_session",
    "/server_info",
    "/get_server_info",  # SGLang 0.5.23 shows its --admin-api-key and --api-key there, to anyone
)
# What SGLang and its router answer a request they will never serve as it is (a prompt longer
# than the context, top_k above the sampling-mask limit, a field the router's schema refuses).
REFUSED = frozenset({400, 413, 422})


class Proxy:
    """The routes and their state: contract, upstream pool, readiness, metrics and audit events."""

    def __init__(
        self, settings: ProxySettings, cfg: Config, *, nats_url: str | None = None, upstream_api_key: str | None = None
    ):
        """The proxy's ``settings`` and the shared ``cfg`` whole (the contract, the audit mode);
        ``nats_url``: where audit events go (None: nowhere); ``upstream_api_key``: a secret, never a setting."""
        self.settings, self.cfg = settings, cfg
        self.pool = UpstreamPool(
            settings.upstream,
            timeout=settings.upstream_timeout,
            max_response_bytes=settings.max_upstream_response_bytes,
            api_key=upstream_api_key,
        )
        self.upstream = self.pool.url
        self.contract = Contract.from_config(cfg)
        self.vocab_size = settings.vocab_size  # then what the probe learns from the upstream
        self.metrics = ProxyMetrics()
        self.publisher = AuditPublisher(nats_url, self.metrics)
        self.report: ProbeReport | None = None
        self.prober: asyncio.Task | None = None

    @property
    def ready(self) -> bool:
        return self.report is not None and self.report.compatible

    async def start(self) -> None:
        self.publisher.start()
        self.prober = asyncio.create_task(self._probe_until_ready(), name="capability-probe")

    async def stop(self) -> None:
        if self.prober is not None:
            self.prober.cancel()
        await self.publisher.stop()
        await self.pool.close()

    async def run_probe(self) -> ProbeReport:
        report = await probe(self.pool, self.contract, vocab_size=self.settings.vocab_size)
        if report.vocab_size:
            self.vocab_size = report.vocab_size
        if (
            report.compatible != self.ready
            or (self.report and report.cause != self.report.cause)
            or self.report is None
        ):
            if report.compatible:
                log.warning(
                    "upstream %s is compatible with the contract (%s, %s, K=%d): ready",
                    self.upstream,
                    self.contract.endpoint,
                    self.contract.mode,
                    self.contract.k,
                )
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

    async def handle(self, req: Request) -> Reply:
        """Every request: the training paths first (the hot path), then the few cold routes."""
        endpoint = TRAINING_PATHS.get(req.path)
        if endpoint is not None and req.method == b"POST":
            return await self.training(endpoint, req)
        path = req.path.decode("latin-1")
        if path.startswith(ADMIN_PREFIXES):
            message = (
                f"{path} is an engine admin endpoint and is not reachable through the proxy; call each engine directly"
            )
            return 403, orjson.dumps({"error": {"rule": "admin_forbidden", "message": message}}), JSON, []
        if req.method == b"GET":
            if path == "/ready":
                report = self.report
                body = {
                    "ready": self.ready,
                    "cause": report.cause if report else "capability probe not finished",
                    "upstream": self.upstream,
                }
                return 200 if self.ready else 503, orjson.dumps(body), JSON, []
            if path == "/liveness":
                return 200, b'{"status":"ok"}', JSON, []
            if path == "/capabilities":
                return 200, orjson.dumps((await self.run_probe()).to_dict()), JSON, []
            if path == "/metrics":
                return 200, self.metrics.exposition(), CONTENT_TYPE_LATEST.encode(), []
            if req.path in MODEL_INFO:
                return await self.model_info(req)
            if req.path in PASS_THROUGH:
                return await self.forward(req.method, req.target, None, req.headers)
        return (
            404,
            orjson.dumps(
                {"error": {"rule": "not_found", "message": f"{req.method.decode()} {path} is not served by the proxy"}}
            ),
            JSON,
            [],
        )

    async def model_info(self, req: Request) -> Reply:
        """The upstream's model info with ``vocab_size`` added where it reports none (SGLang does
        not) and the proxy has learned it: workers read the vocabulary for their contract check here."""
        status, answer, ctype, extra = await self.forward(req.method, req.target, None, req.headers)
        vocab = await self.known_vocab() if status == 200 else None
        if vocab is not None:
            try:
                info = orjson.loads(answer)
            except orjson.JSONDecodeError:
                return status, answer, ctype, extra
            if isinstance(info, dict) and "vocab_size" not in info:
                answer = orjson.dumps({**info, "vocab_size": vocab})
        return status, answer, ctype, extra

    async def forward(self, method: bytes, target: bytes, body: bytes | None, headers: dict) -> Reply:
        """The upstream's answer as it is, or 502 upstream_unreachable."""
        try:
            status, answer, ctype = await self.pool.request(method, target, body, _sent_headers(headers))
        except OSError as exc:
            return _error(502, self._unreachable(target, exc))
        return status, answer, ctype or JSON, []

    def _unreachable(self, target: bytes, exc: OSError) -> ContractViolation:
        if isinstance(exc, UpstreamTooLarge):
            return ContractViolation(
                "upstream_too_large", f"{self.upstream}{target.decode('latin-1')}: {exc}", expected=exc.limit
            )
        return ContractViolation("upstream_unreachable", f"{self.upstream}{target.decode('latin-1')}: {exc}")

    async def known_vocab(self) -> int | None:
        """The vocabulary size, learned from the upstream on first need (probe.learn_vocab_size)."""
        if self.vocab_size is None:
            self.vocab_size = await learn_vocab_size(self.pool)
        return self.vocab_size

    async def training(self, endpoint: str, req: Request) -> Reply:
        """One training (or eval) request: rewrite, forward, audit, then pass, block or flag the answer."""
        # Nothing asks SGLang for more candidates than the vocabulary holds: that takes its server down.
        vocab = await self.known_vocab()
        max_k = self.settings.max_top_logprobs_num
        limit = max_k if vocab is None else min(max_k, vocab)
        if req.headers.get(EVAL_HEADER) == b"1":
            try:
                check_eval_body(req.body, endpoint, limit, vocab)
            except RequestRejected as exc:
                self.metrics.count(self.metrics.requests, endpoint, "rejected")
                return 400, orjson.dumps(exc.to_dict()), JSON, []
            self.metrics.count(self.metrics.requests, endpoint, "eval")
            return await self.forward(b"POST", req.target, req.body, req.headers)
        started = time.perf_counter()
        binary = _accepts_arrays(req.headers)
        too_many = None if vocab is None else k_above_vocab(self.contract.k, vocab, self.contract.mode)
        if too_many:
            self.metrics.count(self.metrics.requests, endpoint, "rejected")
            message = f"the proxy's --rollout-top-logprobs-num: {too_many}, and restart the proxy"
            return (
                503,
                orjson.dumps(
                    {
                        "error": {
                            "rule": "k_above_vocab",
                            "message": message,
                            "expected": vocab,
                            "found": self.contract.k,
                        }
                    }
                ),
                JSON,
                [],
            )
        try:
            sent = rewrite_request(req.body, endpoint, self.contract, max_k=limit, vocab_size=vocab)
        except RequestRejected as exc:
            self.metrics.count(self.metrics.requests, endpoint, "rejected")
            return 400, orjson.dumps(exc.to_dict()), JSON, []
        self.metrics.count(self.metrics.requests, endpoint, "training")
        sent_at = time.perf_counter()
        status, body, ctype = 0, b"", JSON
        violation, result = None, None
        try:
            status, body, ctype = await self.pool.request(b"POST", req.target, sent.body, _sent_headers(req.headers))
        except OSError as exc:
            violation = self._unreachable(req.target, exc)
        upstream_s = time.perf_counter() - sent_at
        if violation is None:
            violation, result = self._audit(endpoint, status, body, ctype, binary, sent.max_new_tokens)
        added_s = time.perf_counter() - started - upstream_s
        self.metrics.observe_added(added_s)
        self.metrics.count(self.metrics.verdicts, violation.rule if violation else "ok")
        blocked = violation is not None and self.cfg.services.proxy_audit_mode == "enforce"
        if self.publisher.enabled:
            self.publisher.enqueue(
                {
                    "ts": time.time(),
                    "path": req.path.decode("latin-1"),
                    "mode": self.contract.mode,
                    "k": self.contract.k,
                    "audit_mode": self.cfg.services.proxy_audit_mode,
                    "verdict": "fail" if violation else "ok",
                    "action": "blocked" if blocked else "passed",
                    "error": violation.to_dict() if violation else None,
                    "upstream_status": status,
                    "samples": result.samples if result else None,
                    "tokens": result.tokens if result else None,
                    "upstream_ms": upstream_s * 1e3,
                    "added_ms": added_s * 1e3,
                }
            )
        if blocked:  # a refusal keeps its status: the same request would be refused again, the client must not retry it
            return _error(status if violation.rule == "upstream_refused" else 502, violation)
        verdict = b"ok" if violation is None else _verdict(violation).encode()
        if status == 0:  # observe mode and no upstream answer: nothing to pass on
            return _error(502, violation, [(AUDIT_HEADER, verdict)])
        if result is not None and result.reply is not None:
            return status, result.reply, ARRAYS, [(AUDIT_HEADER, verdict)]
        if binary and status == 200:  # observe mode passed a defect: its arrays where it has them, else the JSON
            reply = self._unchecked_arrays(endpoint, body)
            if reply is not None:
                return status, reply, ARRAYS, [(AUDIT_HEADER, verdict)]
        return status, body, ctype or JSON, [(AUDIT_HEADER, verdict)]

    def _unchecked_arrays(self, endpoint: str, body: bytes) -> bytes | None:
        try:
            answered = answer.from_body(body, endpoint, mode=self.contract.mode, k=self.contract.k)
            return response_arrays.encode(answered)
        except Exception:  # noqa: BLE001 - unreadable as arrays: the client gets the JSON and the verdict header
            return None

    def _audit(self, endpoint: str, status: int, body: bytes, ctype: bytes, binary: bool, max_new_tokens: int | None):
        if status in REFUSED:
            text = body[:1000].decode(errors="replace")
            return ContractViolation(
                "upstream_refused",
                f"the upstream refused the request with {status}: {text}",
                expected=200,
                found=status,
            ), None
        if status != 200:
            text = body[:300].decode(errors="replace")
            return ContractViolation(
                "upstream_status", f"the upstream answered {status}: {text}", expected=200, found=status
            ), None
        if self.vocab_size is None:
            return ContractViolation(
                "vocab_unknown", "the upstream reports no vocab_size; start the proxy with --vocab-size"
            ), None
        try:
            return None, audit_body(
                body,
                endpoint=endpoint,
                mode=self.contract.mode,
                k=self.contract.k,
                vocab_size=self.vocab_size,
                content_type=ctype,
                arrays=binary,
                max_new_tokens=max_new_tokens,
            )
        except ContractViolation as exc:
            return exc, None
        except Exception as exc:  # a shape no check anticipated is still a malformed response, never a 500
            log.exception("audit failed on an unexpected response shape")
            return ContractViolation(
                "malformed_response", f"the response could not be audited ({type(exc).__name__}: {exc})"
            ), None


def _accepts_arrays(headers: dict) -> bool:
    """Whether the client's ``Accept`` names the binary answer (parameters and case aside)."""
    accept = headers.get(b"accept")
    return accept is not None and any(part.split(b";", 1)[0].strip().lower() == ARRAYS for part in accept.split(b","))


def _sent_headers(headers: dict) -> list:
    sent = [(b"content-type", headers.get(b"content-type", JSON))]
    return sent + [(h, headers[h]) for h in FORWARDED_HEADERS if h in headers]


def _verdict(v: ContractViolation) -> str:
    parts = [f"fail; rule={v.rule}"] + [
        f"{name}={value}"
        for name, value in (("sample", v.sample), ("row", v.row), ("expected", v.expected), ("found", v.found))
        if value is not None
    ]
    return "; ".join(parts)


def _error(status: int, v: ContractViolation, headers: list | None = None) -> Reply:
    return status, orjson.dumps({"error": v.to_dict()}), JSON, headers or []

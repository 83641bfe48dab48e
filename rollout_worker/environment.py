"""Environments: user code that drives multi-turn sessions through an OpenAI chat client
(docs/design.md section 12).

    async def environment(client: openai.AsyncOpenAI, task: PromptTask) -> float

A task that names an environment (``PromptTask.environment``, ``"module:function"`` or a built-in
of ``shared/toy_tasks.py``, ``chain``; loaded by ``rollout_worker/user_code.py``) runs
``task.n`` sessions of it at once. Each gets a client whose base URL is its own session on a
loopback chat endpoint the worker serves for the task (``/sessions/<id>/v1``); each turn there
is one native /generate through the proxy (``rollout_worker/session.py``), with the header
``X-SMG-Routing-Key: <session id>`` so a router that routes by key keeps a session on one engine.
The environment returns the session's reward; the group's sessions become one batch, a sample
each, with GRPO advantages over the group.

Failures: an engine or proxy failure in any turn fails the task as transient (it is sampled
again, whole, with new sessions); a request the proxy refuses, an environment that raises or
returns no finite reward, a session with no turn, a batch that breaks the contract fail it for
good. A session is trained whole or not at all.

Left out: streaming, ``n`` above 1 per request, tool-call parsing (tools go to the chat template;
replies are text), sampling settings of the environment's own (the run's are used, others refused).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
import uuid
from collections.abc import Callable

import aiohttp
import numpy as np
import orjson
from aiohttp import web

from rollout_worker.packing import pack_trajectories
from rollout_worker.request import generate_body
from rollout_worker.rewards import group_advantages
from rollout_worker.session import ChatTemplate, Session, SessionError
from rollout_worker.user_code import load_function
from rollout_worker.worker import Outcome, Rejected, Transient
from shared import faults, response_arrays
from shared.config import Config
from shared.contract import ContractViolation, check_batch
from shared.response_arrays import ResponseArrays
from shared.task import PromptTask
from shared.toy_tasks import ENVIRONMENTS
from shared.wire import WireError

log = logging.getLogger("centerline.worker")
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"  # smg 0.3.2's session affinity key (docs/sglang.md)


class EnvironmentLoadError(ValueError):
    """An environment that cannot be found; the message names it and what to check."""


@functools.lru_cache(maxsize=64)
def load_environment(spec: str) -> Callable:
    """The coroutine function ``spec`` names: a built-in (``shared/toy_tasks.py``) or ``module:function``."""
    return load_function("environment", spec, ENVIRONMENTS, EnvironmentLoadError, coroutine=True)


async def proxy_generate(http: aiohttp.ClientSession, proxy_url: str, body: dict, routing_key: str) -> ResponseArrays:
    """One training request through the proxy, its audited answer as arrays; ``Transient`` for
    what another attempt may not meet, ``Rejected`` for a request refused as such."""
    url = proxy_url.rstrip("/") + "/generate"
    headers = {
        "Content-Type": "application/json",
        "Accept": response_arrays.MEDIA_TYPE,
        ROUTING_KEY_HEADER: routing_key,
    }
    try:
        async with http.post(url, data=orjson.dumps(body), headers=headers) as resp:
            status, answer, ctype = resp.status, await resp.read(), resp.content_type
            verdict = resp.headers.get("X-Centerline-Audit")
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        raise Transient(f"{url}: {exc!r}") from None
    if status in (400, 413, 422):
        raise Rejected(f"the proxy refused a session's turn with {status}: {answer[:1000].decode(errors='replace')}")
    if status != 200:
        raise Transient(f"{url} answered {status}: {answer[:500].decode(errors='replace')}")
    if ctype != response_arrays.MEDIA_TYPE:
        raise Transient(f"{url} answered {ctype}, not {response_arrays.MEDIA_TYPE} (audit verdict: {verdict})")
    try:
        return response_arrays.decode(answer)
    except WireError as exc:
        raise Transient(f"unusable response from the proxy: {exc}") from None


# Request fields the endpoint refuses unless they say what the run does anyway.
NEUTRAL = {"min_p": 0, "frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1, "n": 1}


class SessionEndpoint:
    """The OpenAI-compatible chat endpoint of one task's sessions, on loopback:
    ``POST /sessions/<id>/v1/chat/completions``. A turn's failure is kept on the endpoint
    (``failures``) as well as answered, so the task fails whatever the environment does with it."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.sessions: dict[str, Session] = {}
        self.failures: list[Exception] = []  # Transient / Rejected of any turn
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self, host: str = "127.0.0.1") -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/sessions/{sid}/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://{host}:{port}"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def open(self, session: Session) -> str:
        """Serve ``session``; its base URL, for an OpenAI client."""
        self.sessions[session.id] = session
        return f"{self.url}/sessions/{session.id}/v1"

    async def _chat(self, request: web.Request) -> web.Response:
        session = self.sessions.get(request.match_info["sid"])
        if session is None:
            return _error(404, f"no session {request.match_info['sid']!r} on this worker", "session_not_found")
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            return _error(400, f"the body is not JSON: {exc}", "invalid_json")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return _error(400, "the body must be an object with a messages list", "invalid_request")
        refused = self.refused(body)
        if refused:
            return _error(400, refused, "unsupported_setting")
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            return _error(400, f"max_tokens: is {limit!r}, expected a positive integer", "invalid_request")
        max_new = min(limit or self.cfg.rollout_max_new_tokens, self.cfg.rollout_max_new_tokens)
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else stop
        try:
            reply = await session.turn(body["messages"], max_new_tokens=max_new, stop=stop, tools=body.get("tools"))
        except SessionError as exc:
            return _error(400, str(exc), exc.code)
        except Transient as exc:
            self.failures.append(exc)
            return _error(503, f"the engine failed this turn, the task will be sampled again: {exc}", "engine_failed")
        except Rejected as exc:
            self.failures.append(exc)
            return _error(400, str(exc), "engine_refused")
        answer = {
            "id": f"chatcmpl-{session.id}-{session.turns}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or "default",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": reply.content},
                    "finish_reason": reply.finish_reason,
                    "logprobs": None,
                }
            ],
            "usage": {
                "prompt_tokens": reply.prompt_tokens,
                "completion_tokens": reply.completion_tokens,
                "total_tokens": reply.prompt_tokens + reply.completion_tokens,
            },
        }
        cached = session.turn_cached_tokens[-1]
        if cached is not None:  # OpenAI's field: the prompt tokens served from SGLang's prefix cache
            answer["usage"]["prompt_tokens_details"] = {"cached_tokens": cached}
        return web.Response(body=orjson.dumps(answer), content_type="application/json")

    def refused(self, body: dict) -> str | None:
        """Why the endpoint refuses a request's own settings, or None: the run's sampling is the
        one trained on, and a session answers one reply at a time."""
        if body.get("stream"):
            return "stream: a session's turn is answered whole; send stream=false"
        for name, want in (("temperature", self.cfg.rollout_temperature), ("top_p", self.cfg.rollout_top_p)):
            value = body.get(name)
            if value is not None and not math.isclose(value, want, rel_tol=1e-9):
                return f"{name}: is {value}, the run samples at {want} (--rollout-{name.replace('_', '-')})"
        for name, neutral in NEUTRAL.items():
            if body.get(name) not in (None, neutral):
                return f"{name}: is {body[name]!r}; a session samples one reply with the run's settings ({neutral})"
        if body.get("logit_bias"):
            return "logit_bias: changes the sampled distribution the candidates describe"
        fmt = body.get("response_format")
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type", "text") == "text"):
            return 'response_format: structured output is constrained decoding; only {"type": "text"} is allowed'
        return None


def _error(status: int, message: str, code: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "code": code, "param": None}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


async def play(
    cfg: Config,
    http: aiohttp.ClientSession,
    tokenizer,
    task: PromptTask,
    n: int,
    timeout: float,
    between_turns: Callable[[int], None] | None = None,
) -> list[tuple[Session, float]]:
    """``n`` sessions of the task's environment at once, each on its own base URL of a loopback
    endpoint, rendered with ``tokenizer``'s chat template (an HF tokenizer) and turned through the
    proxy at ``cfg.proxy_url``; each session with its reward. Raises ``Transient`` or ``Rejected``
    as ``Worker.process`` does. The worker trains on them (``sample_sessions``, which passes its
    failpoint as ``between_turns``: see ``Session``); ``centerline up``'s held-out evaluation scores them."""
    import openai

    try:
        environment = load_environment(task.environment)
    except EnvironmentLoadError as exc:
        raise Rejected(str(exc)) from None
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise Rejected(f"task {task.task_id} names an environment, and the worker's tokenizer has no chat template")
    template = ChatTemplate(tokenizer)
    endpoint = SessionEndpoint(cfg)

    def new_session() -> Session:
        sid = uuid.uuid4().hex  # a new one each attempt: a retried task never resumes a session

        async def generate(input_ids: list[int], max_new_tokens: int, stop: list[str] | None) -> ResponseArrays:
            body = generate_body(cfg, input_ids, max_new_tokens=max_new_tokens, stop=stop)
            return await proxy_generate(http, cfg.proxy_url, body, routing_key=sid)

        return Session(
            sid,
            template,
            generate,
            k=cfg.rollout_top_logprobs_num,
            budget=cfg.rollout_session_max_tokens,
            between_turns=between_turns,
        )

    async def run(session: Session) -> float:
        client = openai.AsyncOpenAI(base_url=endpoint.open(session), api_key="unused", max_retries=0, timeout=timeout)
        try:
            return await environment(client, task)
        finally:
            await client.close()

    sessions = [new_session() for _ in range(n)]
    await endpoint.start()
    try:
        results = await asyncio.gather(*(run(s) for s in sessions), return_exceptions=True)
    finally:
        await endpoint.close()
    if endpoint.failures:  # the engine's failure first, whatever the environment made of it
        raise endpoint.failures[0]
    played = []
    for session, result in zip(sessions, results):
        if isinstance(result, BaseException):
            if isinstance(result, asyncio.CancelledError):
                raise result
            raise Rejected(f"environment {task.environment!r} failed in session {session.id}: {result!r}") from None
        if isinstance(result, bool) or not isinstance(result, (int, float)) or not math.isfinite(result):
            raise Rejected(f"environment {task.environment!r} returned {result!r}, expected a finite reward (a float)")
        if not session.turns:
            raise Rejected(f"environment {task.environment!r} returned without a turn in session {session.id}")
        if session.finish is not None:
            fields = {
                "task_id": task.task_id,
                "session": session.id,
                "turns": session.turns,
                "tokens": len(session.ids),
            }
            log.info("session ended at its token budget after its last complete turn", extra={"fields": fields})
        played.append((session, float(result)))
    return played


async def sample_sessions(worker, task: PromptTask, attempt: int) -> Outcome:
    """``task.n`` sessions of the task's environment, scored, packed as one batch and checked;
    raises ``Transient`` or ``Rejected`` as ``Worker.process`` does."""
    cfg, settings = worker.cfg, worker.settings
    # a fault test kills the worker here, between two turns of a session (@step: the turn arriving)
    between = functools.partial(faults.hit, "worker.between_turns")
    played = await play(cfg, worker.session, worker.tok.chat, task, task.n, settings.request_timeout, between)
    rewards = np.asarray([reward for _, reward in played], np.float64)
    batch = pack_trajectories(
        task,
        [s.trajectory() for s, _ in played],
        rewards,
        group_advantages(rewards, std_norm=cfg.advantage_std_norm),
        attempt=attempt,
        producer=settings.worker_id,
        mode=cfg.rollout_logprobs_mode,
        k=cfg.rollout_top_logprobs_num,
        temperature=cfg.rollout_temperature,
        top_p=cfg.rollout_top_p,
        top_k=cfg.rollout_top_k,
    )
    try:
        check_batch(batch, vocab_size=settings.vocab_size)
    except ContractViolation as exc:
        raise Rejected(f"batch {batch.batch_id!r} breaks the contract ({exc.rule}): {exc}", batch) from None
    caches = [c for c in (s.later_turns_cache() for s, _ in played) if c is not None]
    cache = (sum(p for p, _ in caches), sum(c for _, c in caches))
    return Outcome([batch], rewards, int(batch.loss_mask.sum()), later_turns_cache=cache)

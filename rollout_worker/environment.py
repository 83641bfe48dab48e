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
again, whole, with new sessions); a request the proxy refuses, a turn the endpoint refuses for
good (a template that fails or does not extend the session, an invalid request, an unsupported
setting: ``rollout_worker/chat_request.py``) or any exception inside a turn, an environment that
raises or returns no finite reward, a session with no turn, a batch that breaks the contract fail
it for good (whatever the environment made of the answer), and so do sessions not all back
within the worker's ``environment_timeout`` (cancelled). A history the session did not have and
a turn past the session's budget are refused and logged only: the environment may go on or
finish. A session is trained whole or not at all.

Tool calls: a request's ``tools`` go to the chat template and the reply is parsed by SGLang's parsers
(``rollout_worker/tool_calls.py``) into ``message.tool_calls`` (``finish_reason`` "tool_calls"); a
call that does not parse is answered as text with the failure in ``choices[0].tool_call_error``.

Left out: streaming, ``n`` above 1 per request, sampling settings of the environment's own (the
run's are used, others refused).
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
import httpx
import numpy as np
import orjson
from aiohttp import web

from rollout_worker.chat_request import parse_request
from rollout_worker.failures import Rejected, Transient
from rollout_worker.proxy_call import post
from rollout_worker.request import generate_body
from rollout_worker.session import ChatTemplate, Session, SessionError
from rollout_worker.user_code import load_function
from shared.config import Config
from shared.response_arrays import ResponseArrays
from shared.task import PromptTask
from shared.toy_tasks import ENVIRONMENTS

log = logging.getLogger("centerline.worker")


class EnvironmentLoadError(ValueError):
    """An environment that cannot be found; the message names it and what to check."""


@functools.lru_cache(maxsize=64)
def load_environment(spec: str) -> Callable:
    """The coroutine function ``spec`` names: a built-in (``shared/toy_tasks.py``) or ``module:function``."""
    return load_function("environment", spec, ENVIRONMENTS, EnvironmentLoadError, coroutine=True)


async def proxy_generate(http: aiohttp.ClientSession, proxy_url: str, body: dict, routing_key: str) -> ResponseArrays:
    """A session's turn: one native /generate through the proxy, on the session's ``routing_key``."""
    return await post(http, proxy_url.rstrip("/") + "/generate", body, routing_key)


class SessionEndpoint:
    """The OpenAI-compatible chat endpoint of one task's sessions, on loopback:
    ``POST /sessions/<id>/v1/chat/completions``. Every failure of a turn is answered as a named JSON
    error in OpenAI's shape; one that leaves the session untrainable (an engine's, a fatal refusal,
    any exception) is also kept (``failures``), so the task fails whatever the environment does
    with the answer. ``session_history`` and ``context_length_exceeded`` are answered and logged
    only: the session holds its complete turns, and the environment may go on or finish."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.sessions: dict[str, Session] = {}
        self.failures: list[Exception] = []  # Transient / Rejected of any turn, in the order they came
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
        started = time.perf_counter()
        try:
            asked = parse_request(await request.read(), self.cfg)
            parsed_at = time.perf_counter()
            reply = await session.turn(
                asked.messages,
                max_new_tokens=asked.max_new_tokens,
                stop=asked.stop,
                tools=asked.tools,
                variables=asked.variables,
                call_tools=asked.call_tools,
            )
        except SessionError as exc:
            return self._refuse(session, exc)
        except Transient as exc:
            self.failures.append(exc)
            return _error(503, f"the engine failed this turn, the task will be sampled again: {exc}", "engine_failed")
        except Rejected as exc:
            self.failures.append(exc)
            return _error(400, str(exc), "engine_refused")
        # any other failure inside a turn: answered in OpenAI's shape, never aiohttp's bare 500
        except Exception as exc:  # noqa: BLE001
            reason = f"session {session.id}: the turn failed: {type(exc).__name__}: {exc}"
            self.failures.append(Rejected(f"{reason} (internal_error)"))
            log.error("a session's turn failed; the task will be rejected", extra={"fields": {"reason": reason}})
            return _error(500, f"{reason}; the task will be rejected", "internal_error")
        turned_at = time.perf_counter()
        answer = {
            "id": f"chatcmpl-{session.id}-{session.turns}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": asked.model,
            "choices": [
                {
                    "index": 0,
                    "message": reply.message(),
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
        if reply.parsed.error is not None:  # a call that did not parse: the reply is text, the failure named
            answer["choices"][0]["tool_call_error"] = reply.parsed.error.answer()
        cached = session.turn_cached_tokens[-1]
        if cached is not None:  # OpenAI's field: the prompt tokens served from SGLang's prefix cache
            answer["usage"]["prompt_tokens_details"] = {"cached_tokens": cached}
        body = orjson.dumps(answer)
        # the endpoint's own time in the turn: reading the request, writing the answer (docs/design.md section 12)
        session.turn_stages[-1]["endpoint"] = (parsed_at - started) + (time.perf_counter() - turned_at)
        return web.Response(body=body, content_type="application/json")

    def _refuse(self, session: Session, exc: SessionError) -> web.Response:
        """A refused turn, answered 400 with its code; a fatal one is kept: the session can no longer
        be trained whole, and a retry renders the same template (docs/design.md section 12)."""
        fields = {"session": session.id, "turns": session.turns, "code": exc.code, "reason": str(exc)}
        if exc.fatal:
            self.failures.append(Rejected(f"session {session.id} refused a turn ({exc.code}): {exc}"))
            log.error("a session's turn was refused; the task will be rejected", extra={"fields": fields})
            return _error(400, f"{exc}; the task will be rejected", exc.code)
        log.info("a session's turn was refused; the environment may go on", extra={"fields": fields})
        return _error(400, str(exc), exc.code)


class SharedPool(httpx.AsyncBaseTransport):
    """A task's one connection pool under each session's HTTP client, which closes with its client
    (an environment may close it) and leaves the pool to the task."""

    def __init__(self, pool: httpx.AsyncBaseTransport):
        self.pool = pool

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.pool.handle_async_request(request)

    async def aclose(self) -> None:
        pass


def session_http_client(pool: httpx.AsyncBaseTransport, timeout: float) -> httpx.AsyncClient:
    """A session's OpenAI client's HTTP client, on the task's ``pool``: an ``openai.AsyncOpenAI`` left to
    make its own loads the machine's CA certificates, tens of milliseconds of the event loop every
    session's turns share, once per session, for a loopback endpoint that speaks plain HTTP
    (docs/design.md section 12)."""
    return httpx.AsyncClient(transport=SharedPool(pool), timeout=timeout, follow_redirects=True)


def _error(status: int, message: str, code: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "code": code, "param": None}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def finite_reward(result) -> float | None:
    """An environment's return value as a reward: a real number, numpy's included (a scalar or a
    0-d array), that is finite; None for anything else."""
    if isinstance(result, np.ndarray) and result.ndim == 0:
        result = result[()]
    if isinstance(result, (bool, np.bool_)) or not isinstance(result, (int, float, np.integer, np.floating)):
        return None
    value = float(result)
    return value if math.isfinite(value) else None


async def play(
    cfg: Config,
    http: aiohttp.ClientSession,
    tokenizer,
    task: PromptTask,
    n: int,
    timeout: float,
    between_turns: Callable[[int], None] | None = None,
    deadline: float | None = None,
) -> list[tuple[Session, float]]:
    """``n`` sessions of the task's environment at once, each on its own base URL of a loopback
    endpoint, rendered with ``tokenizer``'s chat template (an HF tokenizer) and turned through the
    proxy at ``cfg.proxy_url``; each session with its reward. Raises ``Transient`` or ``Rejected``
    as ``Worker.process`` does, ``Rejected`` too when the sessions are not all back within
    ``deadline`` seconds (they are cancelled). The worker plays them for training and held-out tasks
    alike (``Worker.sample_sessions``, which passes its failpoint as ``between_turns``: see
    ``Session``; docs/design.md section 9)."""
    import openai

    try:
        environment = load_environment(task.environment)
    except EnvironmentLoadError as exc:
        raise Rejected(str(exc)) from None
    template = ChatTemplate.for_run(tokenizer, cfg)  # Rejected where there is no template
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

    returned = []
    pool = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=None, max_keepalive_connections=n))

    async def run(session: Session) -> float:
        client = openai.AsyncOpenAI(
            base_url=endpoint.open(session),
            api_key="unused",
            max_retries=0,
            timeout=timeout,
            http_client=session_http_client(pool, timeout),
        )
        try:
            reward = await environment(client, task)
            returned.append(session)
            return reward
        finally:
            await client.close()

    sessions = [new_session() for _ in range(n)]
    await endpoint.start()
    try:
        # a hung environment would hold the task, and its worker slot, for good (docs/design.md section 12)
        async with asyncio.timeout(deadline):
            results = await asyncio.gather(*(run(s) for s in sessions), return_exceptions=True)
    except TimeoutError:
        raise Rejected(
            f"environment {task.environment!r}: {n - len(returned)} of {n} sessions had not returned within "
            f"--environment-timeout {deadline:g} s, and were cancelled; nothing of the task is published. Make it "
            "return each session's reward, or raise --environment-timeout (unset, it is --request-timeout x "
            "ceil(--rollout-session-max-tokens / --rollout-max-new-tokens))"
        ) from None
    finally:
        await endpoint.close()
        await pool.aclose()
    if endpoint.failures:  # a kept failure first (an engine's, a fatal refusal), whatever the environment made of it
        raise endpoint.failures[0]
    played = []
    for session, result in zip(sessions, results):
        if isinstance(result, BaseException):
            if isinstance(result, asyncio.CancelledError):
                raise result
            raise Rejected(f"environment {task.environment!r} failed in session {session.id}: {result!r}") from None
        reward = finite_reward(result)
        if reward is None:
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
        played.append((session, reward))
    return played

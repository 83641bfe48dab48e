"""How an environment's OpenAI client reaches its session (docs/design.md section 12).

    openai.AsyncOpenAI -> httpx.AsyncClient -> InProcessTransport -> SessionChat.handle
    -> parse_request -> Session.turn -> the session's engine call (a native /generate) -> completion

``SessionChat`` is a task's sessions as an OpenAI chat endpoint, whatever carries the bytes: it
routes ``POST /sessions/<id>/v1/chat/completions`` to the session's turn and answers every outcome
as a status and a JSON body in OpenAI's shape (``rollout_worker/openai_chat.py``). It keeps each
failure after which a session can no longer be trained whole (``failures``). Two carriers, chosen by
the worker's ``session_transport``:

- ``in-process`` (the default): ``InProcessTransport``, the ``httpx.AsyncBaseTransport`` under each
  session's client, hands the request's body straight to ``SessionChat`` and its answer back as the
  response. No socket, no server, no second HTTP stack; the base URL (``http://in-process/...``)
  names no host.
- ``loopback``: ``LoopbackEndpoint``, an aiohttp server on 127.0.0.1 for the task, for an
  environment that hands its session's base URL (``str(client.base_url)``) to an agent out of its
  Python (a CLI agent in a sandbox). Each turn then crosses two HTTP stacks and a socket.

Each request is answered by a task of its own (``SessionChat.start``): a client that stops waiting
for a turn (its timeout: ``httpx.ReadTimeout``, the ``openai`` client's ``APITimeoutError``) leaves
the turn going on, as a server goes on for a client that hung up, and the turns still running when
the task's sessions end are cancelled, over either transport.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time

import httpx
import orjson

from rollout_worker.failures import Rejected, Transient
from rollout_worker.openai_chat import completion, error_body, parse_request
from rollout_worker.session import Session
from rollout_worker.session_errors import SessionError
from shared.config import Config

log = logging.getLogger("centerline.worker")

TRANSPORTS = ("in-process", "loopback")  # the worker's session_transport
IN_PROCESS_URL = "http://in-process"  # the in-process transport's sessions: no host, no socket
CHAT_ROUTE = re.compile(r"^/sessions/(?P<sid>[^/]+)/v1/chat/completions$")
_JSON = [(b"content-type", b"application/json")]


class SessionChat:
    """A task's sessions as an OpenAI chat endpoint: ``POST /sessions/<id>/v1/chat/completions``. Every
    failure of a turn is answered as a named JSON error in OpenAI's shape; one that leaves the session
    untrainable (an engine's, a fatal refusal, any exception) is also kept (``failures``), so the task
    fails whatever the environment does with the answer. ``session_history`` and
    ``context_length_exceeded`` are answered and logged only: the session holds its complete turns,
    and the environment may go on or finish."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.sessions: dict[str, Session] = {}
        self.failures: list[Exception] = []  # Transient / Rejected of any turn, in the order they came
        self._running: set[asyncio.Task] = set()  # turns started by the in-process transport

    def open(self, session: Session) -> str:
        """Serve ``session``; the path of its base URL, for an OpenAI client."""
        self.sessions[session.id] = session
        return f"/sessions/{session.id}/v1"

    async def handle(self, method: str, path: str, raw: bytes) -> tuple[int, bytes]:
        """The answer to one HTTP request: its status and JSON body."""
        route = CHAT_ROUTE.match(path)
        if route is None:
            message = f"{method} {path}: the session endpoint serves only POST /sessions/<id>/v1/chat/completions"
            return 404, error_body(404, message, "not_found")
        if method != "POST":
            return 405, error_body(
                405, f"{method} {path}: send POST (a chat-completions request)", "method_not_allowed"
            )
        session = self.sessions.get(route["sid"])
        if session is None:
            return 404, error_body(404, f"no session {route['sid']!r} on this worker", "session_not_found")
        return await self.turn(session, raw)

    async def turn(self, session: Session, raw: bytes) -> tuple[int, bytes]:
        """One turn of ``session`` from a chat-completions request's body."""
        started = time.perf_counter()
        try:
            asked = parse_request(raw, self.cfg)
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
            message = f"the engine failed this turn, the task will be sampled again: {exc}"
            return 503, error_body(503, message, "engine_failed")
        except Rejected as exc:
            self.failures.append(exc)
            return 400, error_body(400, str(exc), "engine_refused")
        # any other failure inside a turn: answered in OpenAI's shape, never a bare 500
        except Exception as exc:  # noqa: BLE001
            reason = f"session {session.id}: the turn failed: {type(exc).__name__}: {exc}"
            self.failures.append(Rejected(f"{reason} (internal_error)"))
            log.error("a session's turn failed; the task will be rejected", extra={"fields": {"reason": reason}})
            return 500, error_body(500, f"{reason}; the task will be rejected", "internal_error")
        turned_at = time.perf_counter()
        answer = completion(
            reply,
            answer_id=f"chatcmpl-{session.id}-{session.turns}",
            model=asked.model,
            cached_tokens=session.turn_cached_tokens[-1],
        )
        body = orjson.dumps(answer)
        # the endpoint's own time in the turn: reading the request, writing the answer (docs/design.md section 12)
        session.turn_stages[-1]["endpoint"] = (parsed_at - started) + (time.perf_counter() - turned_at)
        return 200, body

    def _refuse(self, session: Session, exc: SessionError) -> tuple[int, bytes]:
        """A refused turn, answered 400 with its code; a fatal one is kept: the session can no longer
        be trained whole, and a retry renders the same template (docs/design.md section 12)."""
        fields = {"session": session.id, "turns": session.turns, "code": exc.code, "reason": str(exc)}
        if exc.fatal:
            self.failures.append(Rejected(f"session {session.id} refused a turn ({exc.code}): {exc}"))
            log.error("a session's turn was refused; the task will be rejected", extra={"fields": fields})
            return 400, error_body(400, f"{exc}; the task will be rejected", exc.code)
        log.info("a session's turn was refused; the environment may go on", extra={"fields": fields})
        return 400, error_body(400, str(exc), exc.code)

    def start(self, method: str, path: str, raw: bytes) -> asyncio.Task:
        """``handle`` as a task of its own, which outlives a client that stops waiting for it."""
        task = asyncio.ensure_future(self.handle(method, path, raw))
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return task

    async def close(self) -> None:
        """Cancel the turns still running (their clients gave up, or the task's sessions ended)."""
        running = list(self._running)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)


class InProcessTransport(httpx.AsyncBaseTransport):
    """The transport under a session's OpenAI client: each request handed to ``chat`` in this process,
    its answer returned as the response; the client's read timeout bounds the wait."""

    def __init__(self, chat: SessionChat):
        self.chat = chat

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        raw = await request.aread()
        read = (request.extensions.get("timeout") or {}).get("read")
        answering = self.chat.start(request.method, request.url.path, raw)
        try:
            status, body = await asyncio.wait_for(asyncio.shield(answering), read)
        except TimeoutError:
            raise httpx.ReadTimeout(f"the session's turn took longer than {read:g} s", request=request) from None
        return httpx.Response(status, headers=_JSON, content=body, request=request)

    async def aclose(self) -> None:
        pass  # the task's: SessionChat.close ends what is running


class LoopbackEndpoint:
    """``chat`` served over HTTP on ``host`` (an ephemeral port), for an agent out of process; every
    path goes to ``SessionChat.handle``, so both transports answer alike."""

    def __init__(self, chat: SessionChat, host: str = "127.0.0.1"):
        self.chat, self.host = chat, host
        self.url = ""
        self._runner = None

    async def start(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{path:.*}", self._serve)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        self.url = f"http://{self.host}:{self._runner.addresses[0][1]}"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _serve(self, request):
        from aiohttp import web

        status, body = await self.chat.start(request.method, request.path, await request.read())
        return web.Response(status=status, body=body, content_type="application/json")


class SharedPool(httpx.AsyncBaseTransport):
    """A task's one transport under each session's HTTP client, which closes with its client (an
    environment may close it) and leaves the transport to the task."""

    def __init__(self, pool: httpx.AsyncBaseTransport):
        self.pool = pool

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.pool.handle_async_request(request)

    async def aclose(self) -> None:
        pass


class SessionClients:
    """A task's sessions' OpenAI clients over ``transport`` (``TRANSPORTS``), between ``start`` and
    ``close`` (or ``async with``): the loopback server and its connection pool live as long, and the
    turns still running at ``close`` are cancelled; ``failures``: the chat's kept ones. Each client's
    HTTP client is the task's: an ``openai.AsyncOpenAI`` left to make its own loads the machine's CA
    certificates, tens of milliseconds of the event loop every session's turns share, once per
    session (docs/design.md section 12)."""

    def __init__(self, chat: SessionChat, transport: str, timeout: float, sessions: int = 16):
        if transport not in TRANSPORTS:
            raise ValueError(f"session_transport: is {transport!r}; use one of {', '.join(TRANSPORTS)}")
        self.chat, self.transport, self.timeout, self.sessions = chat, transport, timeout, sessions
        self.endpoint: LoopbackEndpoint | None = None
        self.pool: httpx.AsyncBaseTransport = InProcessTransport(chat)
        self.base_url = IN_PROCESS_URL

    @property
    def failures(self) -> list[Exception]:
        return self.chat.failures

    async def start(self) -> None:
        if self.transport == "loopback":
            self.endpoint = LoopbackEndpoint(self.chat)
            await self.endpoint.start()
            self.base_url = self.endpoint.url
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=self.sessions)
            self.pool = httpx.AsyncHTTPTransport(limits=limits)

    async def close(self) -> None:
        await self.chat.close()
        if self.endpoint is not None:
            await self.endpoint.close()
        await self.pool.aclose()

    async def __aenter__(self) -> SessionClients:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def client(self, session: Session):
        """An ``openai.AsyncOpenAI`` whose base URL is ``session``'s."""
        import openai

        return openai.AsyncOpenAI(
            base_url=self.base_url + self.chat.open(session),
            api_key="unused",
            max_retries=0,
            timeout=self.timeout,
            http_client=httpx.AsyncClient(transport=SharedPool(self.pool), timeout=self.timeout, follow_redirects=True),
        )

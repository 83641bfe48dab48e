"""The proxy's HTTP/1.1 server: an asyncio ``Protocol`` over ``httptools.HttpRequestParser``.

    front = Front(handler)          # handler(Request) -> Reply, a coroutine
    await front.start("127.0.0.1", 30010)
    ...
    await front.shutdown(grace=10.0)

Why not uvicorn + FastAPI (and an aiohttp client): that proxy spent several times the CPU per
request of the whole proxy here, rewrite and audit included (``centerline bench proxy`` measures
this server against a direct request). It does what the proxy needs and nothing else:
keep-alive, pipelined requests answered in order, Content-Length or chunked request bodies,
``Expect: 100-continue``, one ``write`` per response, and a request body limit: a larger
declared Content-Length is refused with 413 before the body is read (and before
``100 Continue``), a larger chunked body as soon as it crosses the limit. No streaming
responses, no upgrades.

A refused request is answered after the requests before it on its connection; then the
proxy closes its side for writing and discards what the client still sends for up to
``LINGER_S``: closing at once, with the client's unread body in the socket, would reset the
connection and could destroy the answer before the client reads it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus

import httptools
import orjson

from shared.settings import MAX_REQUEST_BODY_BYTES

log = logging.getLogger("centerline.proxy")

PIPELINE_LIMIT = 16  # queued requests on one connection before we stop reading from it
LINGER_S = 2.0  # after refusing a request, how long its connection drains the client's bytes
REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


class Request:
    """One parsed request: ``headers`` maps lower-case names to values, both bytes; ``target`` keeps the query."""

    __slots__ = ("method", "target", "path", "headers", "body", "keep_alive")

    def __init__(self, method: bytes, target: bytes, headers: dict, body: bytes, keep_alive: bool):
        self.method, self.target, self.headers, self.body, self.keep_alive = method, target, headers, body, keep_alive
        self.path = target.split(b"?", 1)[0] if b"?" in target else target


# (status, body, content type, extra (name, value) byte pairs)
Reply = tuple[int, bytes, bytes, list]
Handler = Callable[[Request], Awaitable[Reply]]


class _Connection(asyncio.Protocol):
    def __init__(self, handler: Handler, connections: set, max_body_bytes: int):
        self.handler, self.connections, self.max_body_bytes = handler, connections, max_body_bytes
        self.parser = httptools.HttpRequestParser(self)
        self.transport = None
        self.queue: collections.deque[Request] = collections.deque()
        self.serving = False  # a task is answering this connection's queue
        self.closing = False
        self.paused = False
        self.rejection: tuple[int, bytes] | None = (
            None  # the answer to a refused request, once those before it are answered
        )

    def connection_made(self, transport):
        self.transport = transport
        self.loop = asyncio.get_running_loop()  # once per connection: each call costs a getpid() syscall
        self.connections.add(self)

    def connection_lost(self, exc):
        self.connections.discard(self)
        self.closing = True

    def data_received(self, data):
        if self.rejection is not None:  # refused: nothing more is parsed on this connection
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject(501, "bad_request", "upgrades are not supported")
        except httptools.HttpParserError as exc:
            self._reject(400, "bad_request", str(exc))

    # -- httptools callbacks

    def on_message_begin(self):
        self.target, self.headers, self.chunks, self.size = b"", {}, [], 0

    def on_url(self, url: bytes):
        self.target += url

    def on_header(self, name: bytes, value: bytes):
        self.headers[name.lower()] = value  # bytes: most are never read, so none is decoded

    def on_headers_complete(self):
        declared = self.headers.get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            self._too_large(f"the request body is {int(declared)} bytes (Content-Length)")
        elif self.headers.get(b"expect", b"").lower() == b"100-continue":
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes):
        if self.rejection is not None:
            return
        self.size += len(body)
        if self.size > self.max_body_bytes:
            self.chunks = []
            self._too_large(f"the request body exceeds {self.max_body_bytes} bytes")
        else:
            self.chunks.append(body)

    def on_message_complete(self):
        if self.rejection is not None:  # the rest of a refused request, parsed from the same read
            return
        body = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        self.queue.append(
            Request(self.parser.get_method(), self.target, self.headers, body, self.parser.should_keep_alive())
        )
        if not self.serving:
            self.serving = True
            self.loop.create_task(self._serve())
        elif len(self.queue) >= PIPELINE_LIMIT and not self.paused:
            self.paused = True
            self.transport.pause_reading()

    # -- answering

    async def _serve(self) -> None:
        """Answer queued requests in order (HTTP/1.1 pipelining), one task per burst rather than per request."""
        while self.queue and not self.closing:
            request = self.queue.popleft()
            try:
                status, body, ctype, extra = await self.handler(request)
            except Exception:
                log.exception(
                    "unhandled error answering %s %s", request.method.decode(), request.target.decode("latin-1")
                )
                status, body, ctype, extra = (
                    500,
                    b'{"error": {"rule": "internal", "message": "internal proxy error"}}',
                    b"application/json",
                    [],
                )
            if self.closing:  # the client went away meanwhile
                break
            self._write(status, body, ctype, extra, request.keep_alive)
            if not request.keep_alive:
                self.closing = True
                self.transport.close()
            elif self.paused and len(self.queue) < PIPELINE_LIMIT // 2 and self.rejection is None:
                self.paused = False
                self.transport.resume_reading()
        self.serving = False
        if self.rejection is not None and not self.closing:
            self._close_rejected()

    def _write(self, status: int, body: bytes, ctype: bytes, extra: list, keep_alive: bool) -> None:
        head = [
            b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n"
            % (status, REASONS.get(status, b"Unknown"), ctype, len(body))
        ]
        head += [b"%s: %s\r\n" % pair for pair in extra]
        if not keep_alive:
            head.append(b"connection: close\r\n")
        head.append(b"\r\n")
        if len(body) > 65536:  # a large body goes out without being copied into the head
            self.transport.writelines((b"".join(head), body))
        else:
            head.append(body)
            self.transport.write(b"".join(head))

    def _too_large(self, what: str) -> None:
        message = f"{what}, above the proxy's limit of {self.max_body_bytes} bytes (--max-request-body-bytes)"
        self._reject(413, "request_too_large", message, limit=self.max_body_bytes)

    def _reject(self, status: int, rule: str, message: str, **extra) -> None:
        """A request that cannot be served: answered after the requests before it, then the connection drains and
        closes."""
        if self.rejection is not None:
            return
        self.rejection = (status, orjson.dumps({"error": {"rule": rule, "message": message, **extra}}))
        if not self.serving:
            self._close_rejected()

    def _close_rejected(self) -> None:
        status, body = self.rejection
        self._write(status, body, b"application/json", [], False)
        self.closing = True
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the answer and a FIN; reading goes on, discarding, until the client closes
            self.transport.resume_reading()
            self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()


class Front:
    """The listening socket and its open connections."""

    def __init__(self, handler: Handler, *, max_body_bytes: int = MAX_REQUEST_BODY_BYTES):
        self.handler, self.max_body_bytes = handler, max_body_bytes
        self.connections: set[_Connection] = set()
        self.server: asyncio.Server | None = None

    async def start(self, host: str, port: int, *, backlog: int = 2048) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(
            lambda: _Connection(self.handler, self.connections, self.max_body_bytes), host, port, backlog=backlog
        )

    async def shutdown(self, grace: float) -> None:
        """Stop accepting, let requests in progress finish for up to ``grace`` seconds, then close every connection."""
        self.server.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while any(conn.serving for conn in self.connections) and loop.time() < deadline:
            for conn in list(self.connections):
                if not conn.serving:
                    conn.transport.close()
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            conn.transport.close()

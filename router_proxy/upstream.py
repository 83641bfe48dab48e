"""The proxy's HTTP/1.1 client: a keep-alive connection pool to one upstream (an SGLang router or server).

    pool = UpstreamPool("http://127.0.0.1:30001", timeout=1800, max_connections=512)
    headers = [(b"content-type", b"application/json")]
    status, body, content_type = await pool.request(b"POST", b"/generate", body, headers)

Each connection is an asyncio ``Protocol`` whose bytes go through ``httptools.HttpResponseParser``
(llhttp, C): one ``write`` per request, no stream objects, no per-request task. Bodies may be
Content-Length, chunked (uvicorn streams some responses that way) or delimited by the upstream
closing the connection. Why not aiohttp: see ``front.py`` for what the pair saves; its
client was a quarter of the old proxy's per-request CPU (py-spy under ``centerline bench proxy``).

A request that fails on a *reused* connection before any response byte arrived is retried
once on a fresh one: the upstream closed its idle keep-alive connection as we sent, and never
read the request. Any other failure raises ``UpstreamError``. An answer larger than
``max_response_bytes`` (head and body as received) raises ``UpstreamTooLarge`` as soon as it
crosses the bound, so a hostile upstream cannot make the proxy buffer more than that; bytes
nobody asked for (after a complete answer, on an idle connection) close the connection.

The upstream API key (``upstream_key_from_env``): an SGLang router or server started with
``--api-key`` answers 401 to every request without it, so the proxy and ``centerline probe``
send their own, from ``CENTERLINE_UPSTREAM_API_KEY`` or the file
``CENTERLINE_UPSTREAM_API_KEY_FILE`` names (read as the engines' admin key is,
``shared/admin_key.py``), and never forward a client's.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import typing
import urllib.parse

import httptools

from shared import admin_key
from shared.settings import MAX_UPSTREAM_RESPONSE_BYTES

UPSTREAM_KEY_ENV = "CENTERLINE_UPSTREAM_API_KEY"
UPSTREAM_KEY_FILE_ENV = "CENTERLINE_UPSTREAM_API_KEY_FILE"

CLOSE_DELIMITED = -1


def upstream_key_from_env(env: typing.Mapping[str, str] | None = None) -> str | None:
    """The API key the proxy and the probe send to their upstream (an SGLang router or server
    started with ``--api-key``): ``CENTERLINE_UPSTREAM_API_KEY`` or the file
    ``CENTERLINE_UPSTREAM_API_KEY_FILE`` names. The proxy's own, never a client's."""
    key = admin_key.key_from_env(env, variable=UPSTREAM_KEY_ENV, file_variable=UPSTREAM_KEY_FILE_ENV)
    if key is not None and not all(33 <= ord(c) < 127 for c in key):  # it goes into an HTTP header line as it is
        raise admin_key.AdminKeyError(
            f"{UPSTREAM_KEY_ENV}: the key holds whitespace, control or non-ASCII characters; use printable ASCII"
        )
    return key


class UpstreamError(OSError):
    """The upstream could not be reached, timed out, or answered something that is not HTTP/1.1."""


class UpstreamTooLarge(UpstreamError):
    """The upstream's answer crossed ``max_response_bytes``; ``limit`` is that bound."""

    def __init__(self, message: str, limit: int):
        super().__init__(message)
        self.limit = limit


class _Connection(asyncio.Protocol):
    """One keep-alive connection; at most one request in flight (no pipelining: one slow generation would stall the
    rest)."""

    def __init__(self, pool: UpstreamPool):
        self.pool = pool
        self.parser = httptools.HttpResponseParser(self)
        self.transport = None
        self.closed = False
        self.reused = False
        self.waiter: asyncio.Future | None = None
        self.timer = None
        self.chunks: list[bytes] = []
        self.content_type = b""
        self.framing = 0  # 0 before headers; CLOSE_DELIMITED when neither content-length nor chunked
        self.received = 0  # bytes of the current answer so far
        self.done = False

    # -- asyncio.Protocol

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        waiter = self.waiter
        if waiter is None or waiter.done():  # nobody waits: unsolicited bytes, or the rest of a failed answer
            self.transport.abort()
            return
        self.received += len(data)
        limit = self.pool.max_response_bytes
        if self.received > limit:
            self.chunks = []
            self._fail(
                UpstreamTooLarge(f"the upstream's answer exceeds {limit} bytes (--max-upstream-response-bytes)", limit)
            )
            self.transport.abort()
            return
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._fail(
                UpstreamError(f"the upstream answered something that is not HTTP/1.1 ({type(exc).__name__}: {exc})")
            )
            self.transport.abort()

    def connection_lost(self, exc):
        self.closed = True
        self.pool._forget(self)
        if self.waiter is None or self.waiter.done():
            return
        if self.framing == CLOSE_DELIMITED and not self.done:  # the body ends where the connection does
            self._finish(keep=False)
        elif self.reused and not self.received:
            self._fail(_Retry())
        else:
            self._fail(UpstreamError(f"the upstream closed the connection mid-response ({exc or 'EOF'})"))

    # -- httptools callbacks

    def on_message_begin(self):
        if self.waiter is None:  # a second answer in the same read as the first: not reusable
            self.transport.abort()
        self.chunks, self.content_type, self.framing, self.done = [], b"", 0, False

    def on_header(self, name: bytes, value: bytes):
        name = name.lower()
        if name == b"content-type":
            self.content_type = value
        elif name in (b"content-length", b"transfer-encoding"):
            self.framing = 1

    def on_headers_complete(self):
        status = self.parser.get_status_code()
        if not self.framing and status >= 200 and status not in (204, 304):
            self.framing = CLOSE_DELIMITED

    def on_body(self, body: bytes):
        if self.waiter is not None:  # else bytes after the answer, in the same read: dropped with the connection
            self.chunks.append(body)

    def on_message_complete(self):
        if self.parser.get_status_code() < 200:  # 100 Continue and friends: the real answer follows
            return
        self._finish(keep=self.parser.should_keep_alive())

    # -- requests

    def send(self, head: bytes, body: bytes | None, timeout: float) -> asyncio.Future:
        self.waiter = self.pool.loop.create_future()
        self.received = 0
        self.timer = self.pool.loop.call_later(timeout, self._timed_out, timeout)
        if body and len(body) > 65536:  # a large body goes out without being copied into the head
            self.transport.writelines((head, body))
        else:
            self.transport.write(head + body if body else head)
        return self.waiter

    def _finish(self, keep: bool):
        self.done = True
        waiter, self.waiter, chunks, self.chunks = self.waiter, None, self.chunks, []
        if waiter is None or waiter.done():  # a second answer nobody asked for, or one that already failed
            self.transport.abort()
            return
        self.timer.cancel()
        waiter.set_result(
            (self.parser.get_status_code(), chunks[0] if len(chunks) == 1 else b"".join(chunks), self.content_type)
        )
        if keep and not self.closed:
            self.reused = True
            self.pool._release(self)
        else:
            self.transport.close()

    def _fail(self, exc: Exception):
        if self.timer is not None:
            self.timer.cancel()
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)

    def _timed_out(self, timeout: float):
        self._fail(UpstreamError(f"no complete answer from the upstream within {timeout:g} s"))
        self.transport.abort()


class _Retry(Exception):
    """Internal: the request never reached the upstream (stale keep-alive connection)."""


class UpstreamPool:
    """Keep-alive connections to ``url`` (``http://`` or ``https://``, optionally with a path prefix)."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 1800.0,
        connect_timeout: float = 10.0,
        max_connections: int = 512,
        max_response_bytes: int = MAX_UPSTREAM_RESPONSE_BYTES,
        api_key: str | None = None,
    ):
        """``api_key``: sent as ``Authorization: Bearer`` on every request (an upstream started with ``--api-key``)."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"upstream URL {url!r}: expected http://host:port or https://host:port")
        self.url = url.rstrip("/")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/").encode()
        self.host_header = parts.netloc.encode()
        self.auth = b"authorization: Bearer %s\r\n" % api_key.encode() if api_key else b""
        self.timeout, self.connect_timeout, self.max_connections = timeout, connect_timeout, max_connections
        self.max_response_bytes = max_response_bytes
        self.idle: list[_Connection] = []  # LIFO: the warmest connection first
        self.opened = 0
        self.waiters: collections.deque[asyncio.Future] = collections.deque()
        self.loop: asyncio.AbstractEventLoop | None = None

    async def request(
        self, method: bytes, path: bytes, body: bytes | None = None, headers=()
    ) -> tuple[int, bytes, bytes]:
        """``(status, body, content type)`` of one request (content type ``b""`` when absent); ``headers`` are ``(name,
        value)`` byte pairs."""
        head = b"%s %s%s HTTP/1.1\r\nhost: %s\r\n%s%s%s\r\n" % (
            method,
            self.prefix,
            path,
            self.host_header,
            self.auth,
            b"".join([b"%s: %s\r\n" % pair for pair in headers]),
            b"" if body is None else b"content-length: %d\r\n" % len(body),
        )
        for attempt in (0, 1):
            conn = await self._acquire(fresh=attempt == 1)
            try:
                return await conn.send(head, body, self.timeout)
            except _Retry:
                continue
            except BaseException:
                if not conn.closed:  # a cancelled or failed request leaves the connection in an unknown state
                    conn.transport.abort()
                raise
        raise AssertionError("unreachable")

    async def close(self) -> None:
        for conn in list(self.idle):
            conn.transport.close()
        self.idle.clear()

    async def _acquire(self, fresh: bool) -> _Connection:
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        while self.idle and not fresh:
            conn = self.idle.pop()
            if not conn.closed and not conn.transport.is_closing():
                return conn
        while self.opened >= self.max_connections:
            waiter = self.loop.create_future()
            self.waiters.append(waiter)
            try:
                conn = await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled() and waiter.result() is not None:
                    self._release(waiter.result())  # handed a connection just as we were cancelled: pass it on
                raise
            if conn is not None and not conn.closed and not conn.transport.is_closing():
                if not fresh:
                    return conn
                conn.transport.close()  # a retry wants a new connection: make room for it (_forget wakes us)
        self.opened += 1
        try:
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(lambda: _Connection(self), self.host, self.port, ssl=self.ssl),
                self.connect_timeout,
            )
        except (TimeoutError, OSError) as exc:
            self.opened -= 1
            self._wake(None)
            raise UpstreamError(f"cannot connect to {self.host}:{self.port}: {exc!r}") from None
        return conn

    def _release(self, conn: _Connection) -> None:
        if not self._wake(conn):
            self.idle.append(conn)

    def _forget(self, conn: _Connection) -> None:
        self.opened -= 1
        if conn in self.idle:
            self.idle.remove(conn)
        self._wake(None)  # a waiter may now open a connection of its own

    def _wake(self, conn: _Connection | None) -> bool:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return True
        return False

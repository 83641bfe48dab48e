"""The two ends of the hop ``centerline bench proxy`` measures (``centerline/bench/proxy.py``): a
trivial upstream, run as its own process, and the load generator, run in the bench's.

The upstream answers every POST /generate with one fixed body: ``serve_aiohttp`` (an aiohttp.web
server on uvloop, the default) or ``serve_fixed`` (``--upstream raw``, a bare asyncio protocol);
``python -m centerline.bench.proxy_hop upstream KIND PORT BODY_FILE VOCAB`` runs one. ``load`` is
closed-loop: one keep-alive connection per concurrent client, each sending the next request on the
last reply.
"""

from __future__ import annotations

import asyncio
import sys
import time

import numpy as np
import orjson

# ---------------------------------------------------------------------------- the trivial upstream


def serve_aiohttp(port: int, generate_body: bytes, vocab_size: int) -> None:
    """The default upstream: an aiohttp.web server answering POST /generate with ``generate_body``."""
    import uvloop
    from aiohttp import web

    info = orjson.dumps({"vocab_size": vocab_size})

    async def generate(request):
        await request.read()
        return web.Response(body=generate_body, content_type="application/json")

    async def model_info(_request):
        return web.Response(body=info, content_type="application/json")

    app = web.Application()
    app.add_routes([web.post("/generate", generate), web.get("/model_info", model_info)])
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


def serve_fixed(port: int, generate_body: bytes, vocab_size: int) -> None:
    """``--upstream raw``: answer POST /generate with ``generate_body`` from a bare asyncio protocol, as fast as Python
    can."""
    import uvloop

    def reply(body: bytes) -> bytes:
        return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)

    replies = {b"/generate": reply(generate_body), b"/model_info": reply(orjson.dumps({"vocab_size": vocab_size}))}
    missing = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"

    class Fixed(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport, self.buf = transport, b""

        def data_received(self, data):
            self.buf += data
            while (end := self.buf.find(b"\r\n\r\n")) >= 0:
                head = self.buf[:end].lower()
                at = head.find(b"content-length:")
                length = (
                    int(head[at + 15 : head.find(b"\r\n", at) if head.find(b"\r\n", at) > 0 else None])
                    if at >= 0
                    else 0
                )
                if len(self.buf) < end + 4 + length:
                    return
                self.buf = self.buf[end + 4 + length :]
                self.transport.write(replies.get(head.split(b" ", 2)[1], missing))

    async def run():
        server = await asyncio.get_running_loop().create_server(Fixed, "127.0.0.1", port, backlog=1024)
        await server.serve_forever()

    uvloop.run(run())


# ---------------------------------------------------------------------------- the load generator


class _Client(asyncio.Protocol):
    """One keep-alive connection of the closed loop: send, wait for the whole answer, send again.

    A bare protocol (no streams, no tasks): the generator shares the cores with what it
    measures, so the less CPU it spends per request the less it caps either figure. Answers
    must carry Content-Length (both the upstream and the proxy send it).
    """

    def __init__(
        self, request: bytes, deadline: float, warm_until: float, latencies: list, errors: list, done: asyncio.Future
    ):
        self.request, self.deadline, self.warm_until = request, deadline, warm_until
        self.latencies, self.errors, self.done = latencies, errors, done
        self.buf = b""

    def connection_made(self, transport):
        self.transport = transport
        self._send()

    def _send(self):
        self.sent = time.perf_counter()
        if self.sent >= self.deadline:
            self.transport.close()
            if not self.done.done():
                self.done.set_result(None)
            return
        self.transport.write(self.request)

    def data_received(self, data):
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buf[:end].lower()
        at = head.find(b"content-length:")
        stop = head.find(b"\r\n", at)
        length = int(head[at + 15 : stop if stop > 0 else None])
        if len(self.buf) < end + 4 + length:
            return
        now = time.perf_counter()
        self.buf = self.buf[end + 4 + length :]
        if not head.startswith(b"http/1.1 200"):
            self.errors.append(head.split(b"\r\n", 1)[0].decode())
        if self.sent >= self.warm_until:
            self.latencies.append(now - self.sent)
        self._send()

    def connection_lost(self, exc):
        if not self.done.done():
            self.done.set_result(None)


def load(port: int, concurrency: int, seconds: float, warmup: float = 0.5) -> dict:
    """Closed-loop load: ``concurrency`` keep-alive clients, each sending the next request on the last reply."""
    import uvloop

    body = b'{"text":"The capital of France is","sampling_params":{"max_new_tokens":4}}'
    request = (
        b"POST /generate HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
        % (len(body), body)
    )
    latencies: list[float] = []
    errors: list[str] = []

    async def run():
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        dones = []
        for _ in range(concurrency):
            done = loop.create_future()
            dones.append(done)
            await loop.create_connection(
                lambda done=done: _Client(request, start + warmup + seconds, start + warmup, latencies, errors, done),
                "127.0.0.1",
                port,
            )
        await asyncio.gather(*dones)

    uvloop.run(run())
    if errors:
        raise RuntimeError(f"{len(errors)} requests to port {port} failed, first: {errors[0]}")
    ms = np.array(latencies) * 1e3
    return {
        "rps": round(len(latencies) / seconds, 1),
        "p50_ms": round(float(np.percentile(ms, 50)), 3),
        "p99_ms": round(float(np.percentile(ms, 99)), 3),
    }


if __name__ == "__main__":  # the upstream process, as the module docstring says
    if sys.argv[1:2] == ["upstream"]:
        serve = serve_fixed if sys.argv[2] == "raw" else serve_aiohttp
        serve(int(sys.argv[3]), open(sys.argv[4], "rb").read(), int(sys.argv[5]))

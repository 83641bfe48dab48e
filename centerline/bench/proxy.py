"""`centerline bench proxy [--json]`: what the proxy costs on the wire and per audit.

Three processes share the machine's cores as they would in production: a trivial upstream
(an aiohttp.web server on uvloop by default, ``--upstream raw`` a bare asyncio protocol)
answering every POST /generate with one fixed, valid native response of ``--tokens`` tokens
x ``--k`` candidates; the proxy (``centerline proxy``, its own process); and this process as
the load generator (one asyncio protocol per concurrent client on uvloop, each a keep-alive
connection in a closed loop). Each concurrency runs direct (load -> upstream) and through the
proxy (load -> proxy -> upstream) for ``--seconds``, in ``--rounds`` paired rounds; each
figure is the median over rounds, each ratio the median of the rounds' ratios.

Audit cost (``"audit"``, one entry per ``--audit-tokens``, K=128): ``orjson.loads`` of a native
response (``parse_ms``), and the CPU per response across proxy and worker, before and after.
Before: the proxy's audit (``audit_body``) parses the whole body with orjson and forwards the
JSON, which the worker parses again. After: the audit scans the candidate rows
(``router_proxy/candidate_scan.py``, its C scanner where built: ``"scanner"``; the numpy one's audit
alone is ``numpy_scanner_audit_ms``), and the proxy encodes the arrays it checked as its binary
answer (``shared/response_arrays.py``), which the worker decodes instead of parsing JSON.
Each figure is the median CPU time of ``--repeats``. ``--audit-only`` prints just this table:

    centerline bench proxy --json --audit-only --audit-tokens 1024,8192

Left out: streaming, chat, and TLS; the upstream is deliberately faster than any engine so
that the proxy's own cost shows.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np
import orjson

from centerline.bench import add_out_flag
from centerline.ports import free_port
from centerline.runs.run_figures import write_bench_figures
from centerline.synth import native_response
from router_proxy.audit import audit_body

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


# ---------------------------------------------------------------------------- the benchmark


def _wait_http(url: str, proc: subprocess.Popen, timeout: float, log_path: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}:\n{open(log_path).read()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready after {timeout}s:\n{open(log_path).read()[-2000:]}")
        time.sleep(0.05)


def _cpu_ms(fn, repeats: int) -> float:
    """Median CPU time of ``fn()`` in ms (process time: a busy neighbour on the cores does not count)."""
    fn()  # warm up
    times = []
    for _ in range(repeats):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return statistics.median(times) * 1e3


def audit_cost(repeats: int, tokens: int = 1024, k: int = 128, vocab_size: int = 32768) -> dict:
    """One native response of ``tokens`` x ``k``: orjson.loads of it, and its CPU cost across proxy and
    worker, before and after, in ms per response.

    before: the proxy audits the body parsed whole by orjson and forwards the JSON, which the
    worker parses again (``parse_body``, its samples' metas and arrays). after: the proxy audits with
    candidate rows scanned (``router_proxy/candidate_scan.py``) and encodes the checked arrays as its
    binary answer; the worker decodes them (``shared/response_arrays.py``) and parses nothing.
    ``*_audit_ms`` is the audit alone (what the audit-to-parse ratio compares), ``*_proxy_ms`` the
    proxy's whole share."""
    from rollout_worker.packing import samples_from_arrays
    from router_proxy import answer, candidate_scan, sglang_response
    from shared import response_arrays

    body = native_response(tokens, k, vocab_size)
    reply = audit_body(body, endpoint="generate", mode="selected", k=k, vocab_size=vocab_size, arrays=True).reply

    def audit(arrays: bool):
        return lambda: audit_body(body, endpoint="generate", mode="selected", k=k, vocab_size=vocab_size, arrays=arrays)

    def json_worker():
        doc, _ = sglang_response.parse_body(body, "generate", mode="selected", k=k)
        metas = sglang_response.response_metas(doc, "generate")
        samples_from_arrays(answer.from_parsed(doc, metas, "generate", mode="selected", k=k))

    def binary_worker():
        samples_from_arrays(response_arrays.decode(reply))

    saved, sglang_response.SCAN_MIN_BYTES = sglang_response.SCAN_MIN_BYTES, 1 << 62  # before: nothing scanned
    try:
        before = {"audit": _cpu_ms(audit(False), repeats), "worker": _cpu_ms(json_worker, repeats)}
    finally:
        sglang_response.SCAN_MIN_BYTES = saved
    after = {
        "audit": _cpu_ms(audit(False), repeats),
        "proxy": _cpu_ms(audit(True), repeats),
        "worker": _cpu_ms(binary_worker, repeats),
    }
    before["proxy"] = before["audit"]
    saved, candidate_scan.SCANNER = candidate_scan.SCANNER, "numpy"  # the fallback without a C compiler
    try:
        numpy_audit_ms = _cpu_ms(audit(False), repeats)
    finally:
        candidate_scan.SCANNER = saved
    parse_ms = _cpu_ms(lambda: orjson.loads(body), repeats)
    out = {
        "tokens": tokens,
        "k": k,
        "scanner": candidate_scan.SCANNER,
        "body_bytes": len(body),
        "reply_bytes": len(reply),
        "parse_ms": round(parse_ms, 3),
        "parse_mb_per_s": round(len(body) / parse_ms / 1e3, 1),
    }
    for name, ms in (("before", before), ("after", after)):
        out[f"{name}_audit_ms"] = round(ms["audit"], 3)
        out[f"{name}_proxy_ms"] = round(ms["proxy"], 3)
        out[f"{name}_worker_ms"] = round(ms["worker"], 3)
        out[f"{name}_cpu_ms_per_response"] = round(ms["proxy"] + ms["worker"], 3)
        out[f"{name}_audit_to_parse_ratio"] = round(ms["audit"] / parse_ms, 3)
        out[f"{name}_audit_mb_per_s"] = round(len(body) / ms["audit"] / 1e3, 1)
    out["after_encode_ms"] = round(after["proxy"] - after["audit"], 3)
    out["numpy_scanner_audit_ms"] = round(numpy_audit_ms, 3)
    out["numpy_scanner_audit_to_parse_ratio"] = round(numpy_audit_ms / parse_ms, 3)
    out["cpu_after_to_before"] = round(out["after_cpu_ms_per_response"] / out["before_cpu_ms_per_response"], 3)
    return out


def bench_proxy(argv: list[str]) -> int:
    """Proxy throughput and added latency vs direct, and audit cost vs orjson parse; one JSON object."""
    parser = argparse.ArgumentParser(prog="centerline bench proxy", description=bench_proxy.__doc__)
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--seconds", type=float, default=2.0, help="measured seconds per run")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="paired direct/proxy runs per concurrency; figures are medians over rounds",
    )
    parser.add_argument("--tokens", type=int, default=4, help="tokens in the fixed upstream response")
    parser.add_argument("--k", type=int, default=8, help="candidates per token in the fixed response (the proxy's K)")
    parser.add_argument(
        "--upstream",
        choices=("aiohttp", "raw"),
        default="aiohttp",
        help="aiohttp: an aiohttp.web server (~the 8k req/s upstream the reference figures used); "
        "raw: a bare asyncio protocol",
    )
    parser.add_argument("--repeats", type=int, default=15, help="audit-cost repetitions (median)")
    parser.add_argument(
        "--audit-tokens",
        default="1024,8192",
        help="response lengths (K=128) of the audit-cost table, comma-separated",
    )
    parser.add_argument("--audit-only", action="store_true", help="only the audit-cost table: no processes, no load")
    add_out_flag(parser, "proxy")
    args = parser.parse_args(argv)
    audit = {"audit": [audit_cost(args.repeats, int(n)) for n in args.audit_tokens.split(",") if n]}
    if args.audit_only:
        write_bench_figures(audit, args.out, indent=None if args.json else 2)
        return 0
    vocab = 64
    result: dict = {
        "upstream": f"{args.upstream} on uvloop, fixed valid native response",
        "proxy": "centerline proxy (httptools protocols on uvloop, keep-alive upstream pool)",
        "load_generator": "asyncio protocols on uvloop, one keep-alive connection per client, closed loop",
        "processes": 3,
        "cpus": os.cpu_count(),
        "response_tokens": args.tokens,
        "response_k": args.k,
    }
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            up_port, proxy_port = free_port(), free_port()
            body_path = os.path.join(tmp, "body.json")
            with open(body_path, "wb") as f:
                f.write(native_response(args.tokens, args.k, vocab))
            result["response_bytes"] = os.path.getsize(body_path)
            up_log, proxy_log = os.path.join(tmp, "upstream.log"), os.path.join(tmp, "proxy.log")
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "centerline.bench.proxy",
                        "upstream",
                        args.upstream,
                        str(up_port),
                        body_path,
                        str(vocab),
                    ],
                    stdout=open(up_log, "wb"),
                    stderr=subprocess.STDOUT,
                )
            )
            _wait_http(f"http://127.0.0.1:{up_port}/model_info", procs[0], 30, up_log)
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "centerline.cli",
                        "proxy",
                        "--upstream",
                        f"http://127.0.0.1:{up_port}",
                        "--port",
                        str(proxy_port),
                        "--rollout-top-logprobs-num",
                        str(args.k),
                    ],
                    stdout=open(proxy_log, "wb"),
                    stderr=subprocess.STDOUT,
                )
            )
            _wait_http(f"http://127.0.0.1:{proxy_port}/ready", procs[1], 60, proxy_log)
            rounds = {}
            for c in (1, 32):
                # Paired rounds, direct and proxy back to back in alternating order: a neighbour's
                # load that comes and goes then weighs on both sides of each ratio alike.
                runs = [{} for _ in range(args.rounds)]
                for r, run in enumerate(runs):
                    for name, port in (("direct", up_port), ("proxy", proxy_port))[:: 1 if r % 2 == 0 else -1]:
                        run[name] = load(port, c, args.seconds)
                rounds[c] = runs
                for name in ("direct", "proxy"):
                    for key in ("rps", "p50_ms", "p99_ms"):
                        result[f"{name}_c{c}_{key}"] = round(statistics.median(run[name][key] for run in runs), 3)
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(10)
    result["throughput_ratio_c32_rounds"] = [round(run["proxy"]["rps"] / run["direct"]["rps"], 3) for run in rounds[32]]
    result["added_p50_ms_c1_rounds"] = [round(run["proxy"]["p50_ms"] - run["direct"]["p50_ms"], 3) for run in rounds[1]]
    result["throughput_ratio_c32"] = statistics.median(result["throughput_ratio_c32_rounds"])
    result["added_p50_ms_c1"] = statistics.median(result["added_p50_ms_c1_rounds"])
    result.update(audit)
    write_bench_figures(result, args.out, indent=None if args.json else 2)
    return 0


if __name__ == "__main__":  # the upstream process: python -m centerline.bench.proxy upstream KIND PORT BODY_FILE VOCAB
    if sys.argv[1:2] == ["upstream"]:
        serve = serve_fixed if sys.argv[2] == "raw" else serve_aiohttp
        serve(int(sys.argv[3]), open(sys.argv[4], "rb").read(), int(sys.argv[5]))

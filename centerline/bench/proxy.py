"""`centerline bench proxy [--json]`: what the proxy costs on the wire and per audit.

Three processes share the machine's cores as they would in production: a trivial upstream
(an aiohttp.web server on uvloop by default, ``--upstream raw`` a bare asyncio protocol)
answering every POST /generate with one fixed, valid native response of ``--tokens`` tokens
x ``--k`` candidates; the proxy (``centerline proxy``, its own process); and this process as
the load generator (one asyncio protocol per concurrent client on uvloop, each a keep-alive
connection in a closed loop). The upstream and the load generator are ``proxy_hop.py``. Each
concurrency runs direct (load -> upstream) and through the proxy (load -> proxy -> upstream) for
``--seconds``, in ``--rounds`` paired rounds; each figure is the median over rounds, each ratio
the median of the rounds' ratios.

Audit cost (``"audit"``, one entry per ``--audit-tokens``, K=128; ``audit_cost.py``):
``orjson.loads`` of a native response (``parse_ms``), and the CPU per response across proxy and
worker, before and after.
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
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from centerline.bench import add_out_flag
from centerline.bench.audit_cost import audit_cost
from centerline.bench.proxy_hop import load
from centerline.ports import free_port
from centerline.runs.run_figures import write_bench_figures
from centerline.synth import native_response


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
                        "centerline.bench.proxy_hop",
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

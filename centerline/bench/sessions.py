"""`centerline bench sessions [--json]`: multi-turn sessions, over the loopback endpoint and in
process, beside single requests of the same token counts, in one run; the prefix cache's share of
the later turns' prompts with session affinity (smg ``--policy manual --assignment-mode
min_group``, what ``up`` runs: ``centerline/sglang.py:router_argv``) and without.

The stack, every part real: ``--engines`` SGLang servers of ``--model`` (``centerline sglang``,
the CPU recipe, ``--enable-metrics``; default: the random seed-0 toy model, written by init-model
into ``--model-dir`` once), and per ``--policies`` entry the SGLang router (``smg``,
``centerline/sglang.py:router_argv`` with that policy) in front of all of them and a proxy
(``centerline proxy``, K = ``--k``) in front of the router.

Phase 1 (``session_turns.py``), sessions, once per policy: ``--sessions`` sessions of ``--turns``
turns, ``--concurrency`` at a time, each driven by the real ``openai.AsyncOpenAI`` client as a worker makes it for an
environment (``rollout_worker/session_transport.py``: history check, chat template, native /generate
through the proxy with ``X-SMG-Routing-Key: <session id>``), over each of ``--transports`` for the
first policy (``transports``: ``loopback``, the aiohttp endpoint, before; ``in-process``, the
worker's default, after; each with its own random text) and over the last for the others
(``policies``), as an environment drives it: a user message of ``--user-tokens`` random letters (one token each with
the byte-level toy model), the reply with ``max_tokens`` ``--max-tokens``, the next user message.
A turn's time is the client's, request to answer; its cached tokens are what the answer's
``usage.prompt_tokens_details.cached_tokens`` says (SGLang's ``meta_info.cached_tokens``, carried
by the proxy's binary answer). ``cache_share_later_turns`` = cached / prompt tokens over turns 2
and later, whose history one engine may hold; ``history_cache_share_later_turns`` = cached / the
tokens the session held before each of those turns (the rest of a prompt is the new messages,
which no cache can hold): about 1 with affinity, what the policy happens to give without it.
``same_engine_share_later_turns``: the later turns that went to the engine of their session's
previous turn, told by the cache: only that engine holds the last reply, so such a turn finds all
the history cached but the last sampled token, whose KV no forward pass wrote.
Each policy's sessions have their own random text, so no policy meets another's cache.

Phase 2 (``single_requests.py``), single requests (once, through the first policy's proxy): every turn of that policy's
sessions again as one native /generate of the same token counts, with no session and no routing
key: as many random prompt ids as the turn's prompt tokens (nothing of them in any cache) and
``max_new_tokens`` = the tokens the turn sampled, with ``ignore_eos``, as many at a time as phase 1
had sessions in flight (``--concurrency``, at most ``--sessions``); ``request_ms_by_turn``: their mean
time by the turn they replay.
``overhead_ms_per_turn`` = a session turn's mean time less a single request's: the OpenAI client
and its transport, the template and the session, less what the prefix cache saves in prefill.
``tokens_per_s`` counts sampled tokens over each phase's wall time; ``*_ratio`` is sessions over
single requests. ``*_per_engine``: requests each engine counted in the phase
(``sglang:num_requests_total``; null for a server without ``--enable-metrics``): single
requests spread over the engines under ``manual`` (a request without a key goes to a healthy
engine at random), a session's turns all go to one, and ``manual`` spreads the sessions.

Where a turn's time goes, ``stages_ms`` (milliseconds per turn, mean over the phase's turns): the
worker's stages from the session's own clock (``Session.turn_stages``): ``endpoint`` (reading the
request, writing the answer), ``history`` (the history check), ``render`` (the chat template),
``tokenize`` (the new messages' ids and their check in context), ``reply`` (the reply decoded in
context and parsed); ``client``, the client's time less the endpoint's (the OpenAI client, its
request transform and answer parsing, the transport: loopback HTTP or the in-process hand-over,
and waits for the one event loop all of it shares); past the worker, from the histograms the
servers export, read before and after the phase:
``proxy`` (the proxy's own time, ``centerline_proxy_added_latency_seconds``), ``engine_queue``
(``sglang:queue_time_seconds``), ``engine`` (``sglang:e2e_request_latency_seconds`` less the
queue), and ``router_and_hops`` (the worker's round trip to the proxy less those: smg, the HTTP
hops, SGLang's HTTP front end formatting the top-K answer); null where a server does not export
them (an engine without ``--enable-metrics``). ``single.stages_ms`` holds the same four for the
single requests (their round trip is the request's).

How it grows with the history, ``by_turn``: per turn of the sessions (the ``turn``-th of each), its
mean time, the worker's Python in it (``worker_ms``: endpoint, history, render, tokenize, reply), the
tokens held before it, milliseconds per sampled token, ``single_ms`` (the mean of phase 2's
requests that replayed that turn of the first policy's sessions: the same prompt and sampled token
counts, cold) and ``turn_to_single`` (``turn_ms / single_ms``); ``first_turn_ms_per_token``,
``later_turns_ms_per_token`` and their ratio, ``later_to_first_per_token``; and
``later_to_first_vs_single``, the later turns' mean ``turn_to_single`` over the first turn's: above 1
when a later turn costs more beside a request of its tokens than the first turn does, which the
engine's longer context alone does not explain (single requests attend over the same lengths).
Where the machine's CPU goes (``centerline/bench/cpu.py``), per phase, ``cpu_s``: CPU seconds of the
bench's own process (``bench_process``: phase 1 runs the sessions in it as a worker does, the
environment's OpenAI client included; phase 2 only sends the requests), of each server process tree
it started (``servers``: ``engine-<i>``, ``router``, ``proxy``; null each for ``--engine-urls``),
``others`` (the machine's busy time less those: processes the bench did not start), ``machine`` and
``wall``, and ``machine_busy_share`` (1.0: every core busy the whole phase). From them,
``bench_process_cpu_ms_per_turn`` (phase 1), ``bench_process_cpu_ms_per_request`` (phase 2),
``bench_process_cpu_ms_over_single`` (their difference: what a session turn costs the worker's
Python beyond sending a request), ``client_cpu_ms_per_turn`` (the environment's OpenAI client's own
CPU per turn, the mean of ``by_turn``'s ``client_cpu_ms``: one session's requests replayed after the
phase through the client over a transport that answers each with its recorded answer at once),
``session_path_cpu_ms_per_turn`` (the rest of a turn's: the transport, the endpoint, the session, the
proxy call) and ``engines_cpu_ms_per_sampled_token``: where the engines compute
on the cores the worker runs on (SGLang's CPU recipe), the bench process's CPU and ``others`` are
taken from the engines, and a phase's ``tokens_per_s`` follows. ``cpu_bound_tokens_per_s_ratio``:
the ratio the CPU allows with the machine to the bench alone, every core busy (each phase's CPU per
sampled token compared, the engines' at the single requests' rate, ``others`` left out of both);
null for ``--engine-urls``.

``--turns 2``, ``8``, ``32`` measure sessions of those lengths (the toy model's context is 1,024
tokens: ``--turns 32 --user-tokens 2 --max-tokens 4`` fits; ``--max-total-tokens`` sizes the engines'
KV for longer histories in flight).

A ``--policies`` entry ``manual:MODE`` runs ``manual`` with smg's ``--assignment-mode MODE``: how a
new routing key is placed (``random``, smg's default; ``min_load``, the engine with the fewest
requests in flight; ``min_group``, the fewest keys with a request in flight, what ``manual`` alone
runs). ``--out`` adds the command, the commit and the machine (``centerline/runs/run_figures.py``).

One JSON line per phase on stderr; the result on stdout (``--json``: one line).

    centerline bench sessions --json
    centerline bench sessions --engines 1 --policies manual --sessions 4 --turns 3
    centerline bench sessions --json --policies manual,round_robin --turns 32 --user-tokens 2 --max-tokens 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
import urllib.request
from datetime import datetime
from pathlib import Path

from centerline import sglang
from centerline.bench import add_out_flag
from centerline.bench.cpu import CpuClock, cpu_bound_ratio, engines_ms_per_token
from centerline.bench.session_turns import run_sessions, session_figures
from centerline.bench.single_requests import run_single, single_by_turn
from centerline.bench.turn_stages import growth, mean_ms, stage_table, timings
from centerline.ports import free_port
from centerline.runs.run_figures import write_bench_figures
from centerline.up.processes import PYTHON, Supervisor, sglang_argv, wait_http

POLICIES = ("manual", "cache_aware", "round_robin", "random", "power_of_two")
ASSIGNMENT_MODES = ("random", "min_load", "min_group")  # smg's --assignment-mode for manual
REQUESTS = re.compile(rb"^sglang:num_requests_total(?:\{[^}]*\})? (\S+)$", re.M)


def progress(phase: str, **fields) -> None:
    """One JSON line per phase on stderr."""
    print(json.dumps({"bench": "sessions", "phase": phase, **fields}), file=sys.stderr, flush=True)


def engine_requests(url: str) -> int | None:
    """The requests an engine has counted (``sglang:num_requests_total``, every label set); None
    for an engine started without ``--enable-metrics`` (``--engine-urls``)."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            found = REQUESTS.findall(resp.read())
    except OSError:
        return None
    return int(sum(float(v) for v in found)) if found else None


def counted(before: list, after: list) -> list:
    """Requests per engine between two looks; None for an engine that does not count them."""
    return [None if a is None or b is None else a - b for a, b in zip(after, before)]


def bench_sessions(argv: list[str]) -> int:
    """Session turns vs single requests of the same token counts; prefix-cache share with and without affinity."""
    from rollout_worker.session_transport import TRANSPORTS

    parser = argparse.ArgumentParser(prog="centerline bench sessions", description=bench_sessions.__doc__)
    parser.add_argument("--json", action="store_true", help="print only the JSON object, on one line")
    parser.add_argument("--engines", type=int, default=2, help="SGLang servers started, behind each router")
    parser.add_argument(
        "--engine-urls",
        nargs="+",
        default=None,
        help="running SGLang servers of --model to use instead of starting --engines (per-engine counts need "
        "their --enable-metrics)",
    )
    parser.add_argument(
        "--policies",
        default="manual,cache_aware,round_robin",
        help=f"router policies, in this order, comma-separated, of {', '.join(POLICIES)}; manual (session "
        "affinity) is what up runs, round_robin none; the first one's turns are replayed as single requests",
    )
    parser.add_argument(
        "--transports",
        default="loopback,in-process",
        help=f"session transports (the worker's session_transport: {', '.join(TRANSPORTS)}), in this order, "
        "comma-separated: the first policy's sessions run once over each, the other policies' over the last",
    )
    parser.add_argument("--sessions", type=int, default=16, help="sessions per policy")
    parser.add_argument("--turns", type=int, default=4, help="turns per session")
    parser.add_argument("--user-tokens", type=int, default=48, help="letters of each user message")
    parser.add_argument("--max-tokens", type=int, default=16, help="each turn's max_tokens")
    parser.add_argument("--concurrency", type=int, default=4, help="sessions (phase 2: requests) in flight")
    parser.add_argument("--k", type=int, default=128, help="candidates per token (the proxy's contract)")
    parser.add_argument(
        "--session-max-tokens", type=int, default=1024, help="a session's token budget (--rollout-session-max-tokens)"
    )
    parser.add_argument(
        "--model", default=None, help="HF model directory with a chat template (default: the toy model)"
    )
    parser.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="each started engine's KV cache in tokens (SGLang's flag; default the CPU recipe's): long sessions "
        "in flight need their histories to fit",
    )
    parser.add_argument("--model-dir", type=Path, default=Path("models"), help="where the toy model is written once")
    parser.add_argument("--run-dir", type=Path, default=None, help="logs; default runs/bench-sessions-<date-time>")
    add_out_flag(parser, "sessions")
    args = parser.parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    known = {*POLICIES, *(f"manual:{mode}" for mode in ASSIGNMENT_MODES)}
    if not policies or set(policies) - known or len(set(policies)) != len(policies):
        parser.error(
            f"--policies {args.policies}: distinct names from {', '.join(POLICIES)}, or manual:MODE with MODE one "
            f"of {', '.join(ASSIGNMENT_MODES)}"
        )
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    if not transports or set(transports) - set(TRANSPORTS) or len(set(transports)) != len(transports):
        parser.error(f"--transports {args.transports}: distinct names from {', '.join(TRANSPORTS)}")
    for name in ("engines", "sessions", "turns", "user_tokens", "max_tokens", "concurrency", "k"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    run_dir = args.run_dir or Path("runs") / datetime.now().strftime("bench-sessions-%Y-%m-%d-%H%M%S")
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    if args.engine_urls and not args.model:
        parser.error("--engine-urls: name the model they serve with --model (the chat template and vocabulary)")
    model = args.model or str(toy_model(args.model_dir))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    supervisor = Supervisor(run_dir / "logs", {})
    try:
        result = run(args, policies, transports, model, vocab, supervisor, run_dir / "logs")
    except RuntimeError as exc:
        print(f"centerline bench sessions: {exc}", file=sys.stderr)
        return 1
    finally:
        supervisor.stop()
    write_bench_figures(result, args.out, indent=None if args.json else 2)
    return 0


def toy_model(model_dir: Path) -> Path:
    """The random seed-0 toy model (init-model), written once into ``model_dir``."""
    from centerline.toy.model_init import write_model_dir

    out = model_dir / "init-seed0"
    if not (out / "config.json").is_file():
        write_model_dir(out, seed=0)
    return out


def run(
    args, policies: list[str], transports: list[str], model: str, vocab: int, supervisor: Supervisor, logs: Path
) -> dict:
    started = time.monotonic()
    engines = []
    for i in range(0 if args.engine_urls else args.engines):
        url = f"http://127.0.0.1:{free_port()}"
        flags = ["--enable-metrics"]
        if args.max_total_tokens:
            flags += ["--max-total-tokens", str(args.max_total_tokens)]
        proc = supervisor.start(f"sglang-{i}", sglang_argv(model, url, flags))
        engines.append((url, proc))
    for i, (url, proc) in enumerate(engines):
        wait_http(f"{url}/health", f"SGLang {i}", proc, logs / f"sglang-{i}.log", 600)
    urls = args.engine_urls or [u for u, _ in engines]
    progress("engines_ready", engines=urls, startup_s=round(time.monotonic() - started, 1))
    result = {
        "bench": "sessions",
        "engines": len(urls),
        "sessions": args.sessions,
        "turns": args.turns,
        "user_tokens": args.user_tokens,
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "k": args.k,
        "transports": {},
        "policies": {},
    }
    played_by_run, seeds = {}, iter(range(1 << 20))
    engine_pids = {f"engine-{i}": proc.pid for i, (_, proc) in enumerate(engines)}
    for n, policy in enumerate(policies):
        proxy_url, stack_pids = start_router_and_proxy(supervisor, logs, urls, policy, vocab, args.k)
        cpu = CpuClock({**engine_pids, **stack_pids})
        for transport in transports if n == 0 else transports[-1:]:
            before, timed = [engine_requests(u) for u in urls], timings(urls, proxy_url)
            played = asyncio.run(run_sessions(args, proxy_url, model, next(seeds), transport, cpu))
            after = [engine_requests(u) for u in urls]
            figures = {"transport": transport}
            figures.update(session_figures(played, counted(before, after), timed, timings(urls, proxy_url)))
            played_by_run[id(figures)] = played
            if n == 0:
                result["transports"][transport] = figures
            progress("sessions", policy=policy, **figures)
        result["policies"][policy] = figures  # the last transport's
        if n == 0:
            shapes = [{k: t[k] for k in ("turn", "prompt_tokens", "completion_tokens")} for t in played["turns"]]
            before, timed = [engine_requests(u) for u in urls], timings(urls, proxy_url)
            single = asyncio.run(run_single(args, proxy_url, shapes, vocab, cpu))
            after = [engine_requests(u) for u in urls]
            seconds = [r["seconds"] for r in single["requests"]]
            tokens = sum(r["tokens"] for r in single["requests"])
            result["single"] = {
                "policy": policy,
                "requests": len(seconds),
                "request_ms_mean": mean_ms(seconds),
                "request_ms_p50": round(1000 * statistics.median(seconds), 3),
                "prompt_tokens": sum(t["prompt_tokens"] for t in shapes),
                "sampled_tokens": tokens,
                "tokens_per_s": round(tokens / single["wall_s"], 3),
                "cached_tokens": sum(r["cached"] for r in single["requests"]),
                "requests_per_engine": counted(before, after),
                "wall_s": round(single["wall_s"], 3),
                "stages_ms": stage_table(timed, timings(urls, proxy_url), statistics.fmean(seconds), None),
                "request_ms_by_turn": single_by_turn(single["requests"]),
                "cpu_s": single["cpu_s"],
                "bench_process_cpu_ms_per_request": round(1000 * single["cpu_s"]["bench_process"] / len(seconds), 3),
                "engines_cpu_ms_per_sampled_token": engines_ms_per_token(single["cpu_s"], tokens),
            }
            progress("single", **result["single"])
    single = result["single"]
    for figures in {id(f): f for f in [*result["transports"].values(), *result["policies"].values()]}.values():
        played = played_by_run[id(figures)]
        figures.update(
            growth(played["turns"], played["transform_s"], played["client_cpu_s"], single["request_ms_by_turn"])
        )
        figures["overhead_ms_per_turn"] = round(figures["turn_ms_mean"] - single["request_ms_mean"], 3)
        figures["tokens_per_s_ratio"] = round(figures["tokens_per_s"] / single["tokens_per_s"], 4)
        figures["bench_process_cpu_ms_over_single"] = round(
            figures["bench_process_cpu_ms_per_turn"] - single["bench_process_cpu_ms_per_request"], 3
        )
        figures["session_path_cpu_ms_per_turn"] = round(
            figures["bench_process_cpu_ms_per_turn"] - figures["client_cpu_ms_per_turn"], 3
        )
        figures["cpu_bound_tokens_per_s_ratio"] = cpu_bound_ratio(
            figures["cpu_s"], figures["sampled_tokens"], single["cpu_s"], single["sampled_tokens"]
        )
    return result


def start_router_and_proxy(
    supervisor: Supervisor, logs: Path, engines: list[str], policy: str, vocab: int, k: int
) -> tuple[str, dict[str, int]]:
    """smg with ``policy`` in front of ``engines``, a proxy at K = ``k`` in front of it; the proxy's URL
    once ready, and the two processes' ids (``router``, ``proxy``)."""
    port, proxy_port = free_port(), free_port()
    name, _, assignment = policy.partition(":")  # manual:MODE, smg's --assignment-mode for new keys
    argv = sglang.router_argv(
        engines, "127.0.0.1", port, free_port(), name, assignment or sglang.ROUTER_ASSIGNMENT_MODE
    )
    router = supervisor.start(f"router-{policy.replace(':', '-')}", argv)
    router_url = f"http://127.0.0.1:{port}"
    log = policy.replace(":", "-")
    wait_http(f"{router_url}/readiness", f"router ({policy})", router, logs / f"router-{log}.log", 120)
    argv = [PYTHON, "-m", "centerline", "proxy", "--upstream", router_url, "--host", "127.0.0.1"]
    argv += ["--port", str(proxy_port), "--vocab-size", str(vocab), "--rollout-top-logprobs-num", str(k)]
    proxy = supervisor.start(f"proxy-{log}", argv)
    proxy_url = f"http://127.0.0.1:{proxy_port}"
    wait_http(f"{proxy_url}/ready", f"proxy ({policy})", proxy, logs / f"proxy-{log}.log", 120)
    progress("stack_ready", policy=policy, router=router_url, proxy=proxy_url)
    return proxy_url, {"router": router.pid, "proxy": proxy.pid}

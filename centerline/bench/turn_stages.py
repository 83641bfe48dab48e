"""Where a session turn's time goes, for ``centerline bench sessions`` (``centerline/bench/sessions.py``
says what each figure is): the worker's stages from the session's own clock, the proxy's and the
engines' from the Prometheus histograms they export, and how a turn's cost grows with the history.
"""

from __future__ import annotations

import re
import statistics
import urllib.request

WORKER_STAGES = ("endpoint", "history", "render", "tokenize", "reply")  # the worker's Python in a turn


def mean_ms(seconds: list[float]) -> float:
    return round(1000 * statistics.fmean(seconds), 3) if seconds else 0.0


def histogram(url: str, name: bytes) -> tuple[float, float] | None:
    """``(sum, count)`` of the Prometheus histogram ``name`` at ``url``/metrics, over every label set;
    None where the server does not export it (an engine without ``--enable-metrics``)."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            text = resp.read()
    except OSError:
        return None
    found = []
    for suffix in (b"_sum", b"_count"):
        pattern = re.compile(rb"^" + re.escape(name + suffix) + rb"(?:\{[^}]*\})? (\S+)$", re.M)
        values = pattern.findall(text)
        if not values:
            return None
        found.append(sum(float(v) for v in values))
    return found[0], found[1]


def timings(engines: list[str], proxy_url: str) -> dict:
    """The histograms a phase's per-stage table is read from, as they stand: each engine's request
    latency and queue time (SGLang's), the proxy's own time per training request."""
    return {
        "engine_s": [histogram(u, b"sglang:e2e_request_latency_seconds") for u in engines],
        "queue_s": [histogram(u, b"sglang:queue_time_seconds") for u in engines],
        "proxy_s": [histogram(proxy_url, b"centerline_proxy_added_latency_seconds")],
    }


def mean_between(before: list, after: list) -> float | None:
    """Mean seconds per observation between two looks at histograms, summed over servers; None where
    one of them exports none or nothing was observed."""
    if any(b is None or a is None for a, b in zip(after, before)):
        return None
    total = sum(a[0] - b[0] for a, b in zip(after, before))
    count = sum(a[1] - b[1] for a, b in zip(after, before))
    return total / count if count else None


def stage_table(before: dict, after: dict, request_s: float, generate_s: float | None) -> dict:
    """Milliseconds per request past the client: the proxy's own time, the router and the hops
    between (the round trip less the proxy's and the engine's), the engine's queue and the rest of
    the engine's time; None where a server did not say."""
    proxy, engine, queue = (mean_between(before[k], after[k]) for k in ("proxy_s", "engine_s", "queue_s"))
    upstream = request_s if generate_s is None else generate_s
    router = None if proxy is None or engine is None else upstream - proxy - engine
    return {
        "proxy": ms(proxy),
        "router_and_hops": ms(router),
        "engine_queue": ms(queue),
        "engine": ms(None if engine is None or queue is None else engine - queue),
    }


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 3)


def session_stages(turns: list[dict], before: dict, after: dict) -> dict:
    """Milliseconds per turn in each stage, mean over the turns: the OpenAI client and its transport
    (the client's time less the endpoint's), the endpoint's own, the session's (history check,
    template, tokenization, the reply's decoding and parsing), then past the worker (``stage_table``)."""
    stages = [t["stages"] for t in turns]
    worker = {name: statistics.fmean(st[name] for st in stages) for name in ("generate", *WORKER_STAGES)}
    client = statistics.fmean(t["seconds"] - sum(t["stages"].values()) for t in turns)
    past = stage_table(before, after, worker["generate"], worker["generate"])
    return {"client": ms(client), **{name: ms(worker[name]) for name in WORKER_STAGES}, **past}


def growth(
    turns: list[dict], transform_s: list[float | None], client_cpu_s: list[float], single_ms: list[float]
) -> dict:
    """How a turn's cost grows with the history: per turn of the sessions (the ``turn``-th of each), its
    mean time, the worker's Python in it, the tokens held before it, milliseconds per sampled token,
    the OpenAI client's request transform of its request (``transform_s``, one session's) and the CPU
    the whole client spends on it (``client_cpu_s``, the same session's), the mean
    time of the single requests of the same token counts (``single_ms``, by turn) and the turn's time
    over theirs; the first turn's and the later turns' milliseconds per sampled token, and the later
    turns' mean time-over-single against the first turn's."""
    by_turn = []
    for t in sorted({t["turn"] for t in turns}):
        these = [x for x in turns if x["turn"] == t]
        sampled = sum(x["completion_tokens"] for x in these)
        turn_ms = mean_ms([x["seconds"] for x in these])
        by_turn.append(
            {
                "turn": t + 1,
                "turn_ms": turn_ms,
                "worker_ms": mean_ms([sum(x["stages"][n] for n in WORKER_STAGES) for x in these]),
                "held_tokens": round(statistics.fmean(x["held_tokens"] for x in these), 1),
                "ms_per_sampled_token": round(1000 * sum(x["seconds"] for x in these) / max(sampled, 1), 3),
                "client_transform_ms": ms(transform_s[t]),
                "client_cpu_ms": ms(client_cpu_s[t]),
                "single_ms": single_ms[t],
                "turn_to_single": round(turn_ms / single_ms[t], 4),
            }
        )
    later = [t for t in turns if t["turn"] > 0]
    first = [t for t in turns if t["turn"] == 0]

    def per_token(group: list[dict]) -> float | None:
        sampled = sum(t["completion_tokens"] for t in group)
        return round(1000 * sum(t["seconds"] for t in group) / sampled, 3) if group and sampled else None

    later_vs_single = statistics.fmean(t["turn_to_single"] for t in by_turn[1:]) if later else None
    return {
        "by_turn": by_turn,
        "first_turn_ms_per_token": per_token(first),
        "later_turns_ms_per_token": per_token(later),
        "later_to_first_per_token": round(per_token(later) / per_token(first), 4) if later else None,
        "later_to_first_vs_single": round(later_vs_single / by_turn[0]["turn_to_single"], 4) if later else None,
        "worker_ms_first_turn": by_turn[0]["worker_ms"],
        "worker_ms_last_turn": by_turn[-1]["worker_ms"],
        "client_cpu_ms_per_turn": round(statistics.fmean(t["client_cpu_ms"] for t in by_turn), 3),
    }

"""`centerline bench sessions`: sessions over the loopback endpoint and in process, then single
requests of the same token counts, one JSON object. Tiny sizes on two engines (``--engine-urls``):
the session's shared SGLang server and the session's second one, with ``--enable-metrics``, whose
request count shows the routing, behind a real router (``--policy manual``) and proxy the bench
starts."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SESSIONS, TURNS, USER, MAX_TOKENS = 4, 3, 8, 4
FIGURES = {
    "transport",
    "turns",
    "turn_ms_mean",
    "turn_ms_p50",
    "later_turn_ms_mean",
    "prompt_tokens",
    "sampled_tokens",
    "tokens_per_s",
    "later_turns_prompt_tokens",
    "later_turns_cached_tokens",
    "cache_share_later_turns",
    "later_turns_history_tokens",
    "history_cache_share_later_turns",
    "same_engine_share_later_turns",
    "requests_per_engine",
    "wall_s",
    "overhead_ms_per_turn",
    "tokens_per_s_ratio",
    "stages_ms",
    "by_turn",
    "first_turn_ms_per_token",
    "later_turns_ms_per_token",
    "later_to_first_per_token",
    "later_to_first_vs_single",
    "worker_ms_first_turn",
    "worker_ms_last_turn",
    "cpu_s",
    "bench_process_cpu_ms_per_turn",
    "bench_process_cpu_ms_over_single",
    "engines_cpu_ms_per_sampled_token",
    "client_cpu_ms_per_turn",
    "session_path_cpu_ms_per_turn",
    "cpu_bound_tokens_per_s_ratio",
}
WORKER = ["client", "endpoint", "history", "render", "tokenize", "reply"]
PAST_THE_WORKER = ["proxy", "router_and_hops", "engine_queue", "engine"]


@pytest.fixture
def counting_server(keyed_sglang):
    """The session's second SGLang server, counting its requests (sglang:num_requests_total)."""
    return keyed_sglang


@pytest.mark.integration
@pytest.mark.slow
def test_bench_sessions_prints_session_turns_beside_single_requests_of_the_same_token_counts(
    sglang, counting_server, model_dir, tmp_path
):
    engines = [sglang.url, counting_server.url]
    argv = [sys.executable, "-m", "centerline", "bench", "sessions", "--json", "--engine-urls", *engines]
    argv += ["--model", str(model_dir), "--policies", "manual", "--sessions", str(SESSIONS), "--turns", str(TURNS)]
    argv += ["--user-tokens", str(USER), "--max-tokens", str(MAX_TOKENS), "--run-dir", str(tmp_path / "run")]
    argv += ["--out", str(tmp_path / "sessions.json")]
    run = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    phases = [json.loads(line)["phase"] for line in run.stderr.splitlines() if line.startswith('{"bench"')]
    assert phases == ["engines_ready", "stack_ready", "sessions", "sessions", "single"]  # loopback, in-process
    (line,) = run.stdout.splitlines()
    result = json.loads(line)
    written = json.loads((tmp_path / "sessions.json").read_text())
    assert {k: v for k, v in written.items() if k not in ("command", "commit", "machine", "digest")} == result
    assert {k: result[k] for k in ("bench", "engines", "sessions", "turns", "max_tokens", "k")} == {
        "bench": "sessions",
        "engines": 2,
        "sessions": SESSIONS,
        "turns": TURNS,
        "max_tokens": MAX_TOKENS,
        "k": 128,
    }
    manual, single = result["policies"]["manual"], result["single"]
    assert set(manual) == FIGURES and manual["turns"] == single["requests"] == SESSIONS * TURNS
    # before and after: the same sessions' figures over the loopback endpoint and in process, the
    # policy's over the worker's default
    loopback, in_process = result["transports"]["loopback"], result["transports"]["in-process"]
    assert list(result["transports"]) == ["loopback", "in-process"] and in_process == manual
    assert (loopback["transport"], in_process["transport"]) == ("loopback", "in-process")
    assert set(loopback) == FIGURES and loopback["turns"] == SESSIONS * TURNS
    assert loopback["overhead_ms_per_turn"] == round(loopback["turn_ms_mean"] - single["request_ms_mean"], 3)
    # the same token counts both ways: what the sessions sent and sampled, the single requests did
    assert (single["prompt_tokens"], single["sampled_tokens"]) == (manual["prompt_tokens"], manual["sampled_tokens"])
    assert SESSIONS * TURNS <= manual["sampled_tokens"] <= SESSIONS * TURNS * MAX_TOKENS
    # one engine held each session's history: all of it but at most a token a turn came from its cache
    later = SESSIONS * (TURNS - 1)
    held, cached = manual["later_turns_history_tokens"], manual["later_turns_cached_tokens"]
    assert held - later <= cached <= held < manual["later_turns_prompt_tokens"]
    assert manual["same_engine_share_later_turns"] == 1.0
    assert manual["cache_share_later_turns"] == round(cached / manual["later_turns_prompt_tokens"], 4)
    # routing, as the counting engine saw it (the shared one has no --enable-metrics): every turn of a
    # session on one engine; single requests, which carry no routing key, spread (each of 12 at random:
    # all on one engine one run in 2048)
    (unknown, turns_there), (_, singles_there) = manual["requests_per_engine"], single["requests_per_engine"]
    assert unknown is None and turns_there % TURNS == 0
    assert 0 < singles_there < SESSIONS * TURNS
    assert single["cached_tokens"] <= SESSIONS * TURNS  # random prompts: nothing cached but a shared first id
    for figures in (manual, single):
        assert figures["tokens_per_s"] > 0 and figures["wall_s"] > 0
    # CPU by whom: the engines were not started by the bench (--engine-urls), its router and proxy were
    for figures in (loopback, manual, single):
        cpu = figures["cpu_s"]
        assert set(cpu["servers"]) == {"router", "proxy"} and all(v >= 0 for v in cpu["servers"].values())
        assert cpu["bench_process"] > 0 and cpu["machine"] > 0 and figures["engines_cpu_ms_per_sampled_token"] is None
    assert manual["cpu_bound_tokens_per_s_ratio"] is None and loopback["cpu_bound_tokens_per_s_ratio"] is None
    assert manual["bench_process_cpu_ms_per_turn"] == round(
        1000 * manual["cpu_s"]["bench_process"] / (SESSIONS * TURNS), 3
    )
    assert single["bench_process_cpu_ms_per_request"] == round(
        1000 * single["cpu_s"]["bench_process"] / (SESSIONS * TURNS), 3
    )
    assert manual["bench_process_cpu_ms_over_single"] == round(
        manual["bench_process_cpu_ms_per_turn"] - single["bench_process_cpu_ms_per_request"], 3
    )
    assert manual["turn_ms_mean"] > 0 and single["request_ms_mean"] > 0
    assert manual["overhead_ms_per_turn"] == round(manual["turn_ms_mean"] - single["request_ms_mean"], 3)
    # the code's commit as the bench started: HEAD then, so HEAD now or an ancestor of it
    ancestor = ["git", "merge-base", "--is-ancestor", written["commit"], "HEAD"]
    assert len(written["commit"]) == 40 and subprocess.run(ancestor, cwd=ROOT).returncode == 0


@pytest.mark.integration
@pytest.mark.slow
def test_bench_sessions_times_each_stage_of_a_turn_and_each_turn_of_a_session(
    sglang, counting_server, model_dir, tmp_path
):
    """The worker's stages from the session's own clock; the proxy's from its histogram; the router's
    and the engine's only where every engine exports SGLang's (the shared one has no --enable-metrics)."""
    argv = [sys.executable, "-m", "centerline", "bench", "sessions", "--json"]
    argv += ["--engine-urls", sglang.url, counting_server.url, "--model", str(model_dir)]
    argv += ["--policies", "manual:min_load", "--transports", "in-process", "--sessions", "2", "--turns", "5"]
    argv += ["--user-tokens", "4"]
    argv += ["--max-tokens", "2", "--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "sessions.json")]
    run = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout)
    figures, single = result["policies"]["manual:min_load"], result["single"]
    stages = figures["stages_ms"]
    assert list(stages) == WORKER + PAST_THE_WORKER and list(single["stages_ms"]) == PAST_THE_WORKER
    assert all(stages[name] > 0 for name in WORKER) and stages["proxy"] > 0 and single["stages_ms"]["proxy"] > 0
    assert [stages[n] for n in PAST_THE_WORKER[1:]] == [None, None, None]
    by_turn = figures["by_turn"]
    assert [t["turn"] for t in by_turn] == [1, 2, 3, 4, 5] and by_turn[0]["held_tokens"] == 0
    keys = ["turn", "turn_ms", "worker_ms", "held_tokens", "ms_per_sampled_token", "client_transform_ms"]
    keys += ["client_cpu_ms", "single_ms", "turn_to_single"]
    assert all(list(t) == keys and t["client_cpu_ms"] > 0 and t["client_transform_ms"] > 0 for t in by_turn)
    client = round(sum(t["client_cpu_ms"] for t in by_turn) / 5, 3)
    assert abs(figures["client_cpu_ms_per_turn"] - client) <= 0.001
    assert figures["session_path_cpu_ms_per_turn"] == round(
        figures["bench_process_cpu_ms_per_turn"] - figures["client_cpu_ms_per_turn"], 3
    )
    # each turn beside the single requests that replayed it: the same turn index, the same token counts
    assert [t["single_ms"] for t in by_turn] == single["request_ms_by_turn"] and len(by_turn) == 5
    assert all(t["turn_to_single"] == round(t["turn_ms"] / t["single_ms"], 4) for t in by_turn)
    later_vs_single = sum(t["turn_to_single"] for t in by_turn[1:]) / 4
    assert figures["later_to_first_vs_single"] == round(later_vs_single / by_turn[0]["turn_to_single"], 4)
    assert all(a["held_tokens"] < b["held_tokens"] for a, b in zip(by_turn, by_turn[1:]))
    assert (figures["worker_ms_first_turn"], figures["worker_ms_last_turn"]) == (
        by_turn[0]["worker_ms"],
        by_turn[-1]["worker_ms"],
    )
    ratio = figures["later_turns_ms_per_token"] / figures["first_turn_ms_per_token"]
    assert figures["later_to_first_per_token"] == round(ratio, 4)

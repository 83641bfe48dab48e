"""`centerline bench pipeline`: a short `up` run, then SGLang alone, one JSON object with exact counts."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from centerline.bench_pipeline import duty_cycle

ROOT = Path(__file__).resolve().parents[2]

STEPS, WARMUP, PROMPTS, N, MAX_NEW, ALONE_S = 40, 1, 2, 2, 8, 5.0
PIPELINE_KEYS = {
    "pipeline_window_s",
    "pipeline_steps",
    "samples_total",
    "pipeline_samples",
    "pipeline_tokens",
    "pipeline_samples_per_s",
    "pipeline_tokens_per_s",
    "pipeline_step_s_mean",
    "pipeline_gather_s_mean",
    "pipeline_train_s_mean",
    "duty_cycle",
    "duty_cycle_window_s",
    "duty_cycle_error_bound",
}
ALONE_KEYS = {
    "sglang_alone_window_s",
    "sglang_alone_requests",
    "sglang_alone_samples",
    "sglang_alone_tokens",
    "sglang_alone_samples_per_s",
    "sglang_alone_tokens_per_s",
    "sglang_alone_duty_cycle",
    "sglang_alone_duty_cycle_window_s",
    "sglang_alone_duty_cycle_error_bound",
}
SETTING_KEYS = {
    "task",
    "model",
    "steps",
    "warmup_steps",
    "workers",
    "trainer_ranks",
    "prompts_per_step",
    "rollout_n",
    "rollout_max_new_tokens",
    "rollout_top_logprobs_num",
    "rollout_temperature",
    "concurrent_requests",
    "cpus",
    "run_dir",
}


def test_duty_cycle_measures_between_flushes_dated_at_the_middle_of_their_bracket():
    # (t, idle_s, cpu_s): flushes (cpu changes) between t=1..2 (idle 10 -> 10.5) and t=5..6 (idle -> 11.5);
    # the one between t=0..1 starts before the window, the one between t=7..8 ends after it.
    samples = [(0, 10, 1), (1, 10, 2), (2, 10.5, 3), (3, 10.5, 3), (5, 10.5, 3), (6, 11.5, 4), (7, 11.5, 4), (8, 12, 5)]
    assert duty_cycle(samples, start=0.5, end=7.5) == {
        "duty_cycle": 0.75,
        "duty_cycle_window_s": 4.0,
        "duty_cycle_error_bound": 0.25,
    }


def test_duty_cycle_refuses_a_window_with_fewer_than_two_flushes():
    with pytest.raises(RuntimeError, match="flushed its idle counter 1 times in the 3.0 s window"):
        duty_cycle([(0, 0, 0), (1, 0, 1), (2, 0, 1), (3, 0, 1)], start=0, end=3)


def _processes_mentioning(path: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue  # exited while we looked
            if path in cmdline:
                found.append(f"{entry.name}: {cmdline}")
    return found


@pytest.mark.integration
@pytest.mark.slow
def test_bench_pipeline_reports_counts_rates_and_duty_cycles(tmp_path):
    argv = [
        sys.executable,
        "-m",
        "centerline",
        "bench",
        "pipeline",
        "--json",
        "--task",
        "copy",
        "--steps",
        str(STEPS),
        "--warmup-steps",
        str(WARMUP),
        "--workers",
        "1",
        "--trainer-ranks",
        "1",
        "--prompts-per-step",
        str(PROMPTS),
        "--eval-prompts",
        "2",
        "--model-dir",
        str(tmp_path / "models"),
        "--run-dir",
        str(tmp_path / "run"),
        "--alone-warmup",
        "1",
        "--alone-seconds",
        str(ALONE_S),
        "--",
        "--rollout-n",
        str(N),
        "--rollout-max-new-tokens",
        str(MAX_NEW),
        "--sft-steps",
        "1",
    ]
    run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert _processes_mentioning(str(tmp_path)) == []  # up's services and the SGLang-alone server are all stopped
    phases = [json.loads(line)["phase"] for line in run.stderr.splitlines() if line.startswith('{"bench": "pipeline"')]
    assert phases == ["up", "startup", "pipeline", "sglang_alone_ready", "sglang_alone"]

    r = json.loads(run.stdout)
    assert set(r) == SETTING_KEYS | PIPELINE_KEYS | ALONE_KEYS | {"samples_per_s_ratio", "tokens_per_s_ratio"}
    assert (r["steps"], r["warmup_steps"], r["rollout_n"], r["rollout_max_new_tokens"]) == (STEPS, WARMUP, N, MAX_NEW)
    assert r["concurrent_requests"] == 1 * 2  # one worker, two tasks in flight
    assert r["model"] == str(tmp_path / "models" / "sft-copy-seed0")
    # Every step trains prompts x n samples; the window leaves out the warm-up steps.
    assert r["samples_total"] == STEPS * PROMPTS * N
    assert (r["pipeline_steps"], r["pipeline_samples"]) == (STEPS - WARMUP, (STEPS - WARMUP) * PROMPTS * N)
    assert r["pipeline_samples"] <= r["pipeline_tokens"] <= MAX_NEW * r["pipeline_samples"]
    assert r["pipeline_samples_per_s"] == pytest.approx(r["pipeline_samples"] / r["pipeline_window_s"], rel=1e-3)
    assert r["pipeline_tokens_per_s"] == pytest.approx(r["pipeline_tokens"] / r["pipeline_window_s"], rel=1e-3)
    # SGLang alone: n samples per request.
    assert r["sglang_alone_samples"] == N * r["sglang_alone_requests"] > 0
    assert r["sglang_alone_samples"] <= r["sglang_alone_tokens"] <= MAX_NEW * r["sglang_alone_samples"]
    assert r["sglang_alone_window_s"] == ALONE_S
    assert r["samples_per_s_ratio"] == round(r["pipeline_samples_per_s"] / r["sglang_alone_samples_per_s"], 4)
    assert r["tokens_per_s_ratio"] == round(r["pipeline_tokens_per_s"] / r["sglang_alone_tokens_per_s"], 4)
    for prefix, window in (("", r["pipeline_window_s"]), ("sglang_alone_", r["sglang_alone_window_s"])):
        assert 0 <= r[prefix + "duty_cycle"] <= 1
        assert 0 < r[prefix + "duty_cycle_window_s"] <= window
        assert 0 < r[prefix + "duty_cycle_error_bound"] < 1

"""`centerline bench pipeline`: a short `up` run, then SGLang alone, one JSON object with exact counts."""

import json
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from centerline.bench.duty_cycle import duty_cycle
from centerline.bench.pipeline import BENCH_DEFAULTS, bench_pipeline
from centerline.bench.pipeline_modes import heldout_key, mode_spec, token_staleness
from centerline.bench.sglang_alone import concurrent_requests, request_bodies
from centerline.up.run_spec import parse
from shared.config import Config

ROOT = Path(__file__).resolve().parents[2]

# Each mode trains for TRAIN_S seconds (up --train-seconds), fewer than STEPS steps take.
STEPS, TRAIN_S, WARMUP, PROMPTS, N, MAX_NEW, ALONE_S = 1000, 8.0, 1, 2, 2, 8, 5.0
PIPELINE_KEYS = {
    "max_inflight_steps",
    "weight_update",
    "weight_transport",
    "weight_fallbacks",
    "weights_s_mean",
    "weights_s_max",
    "token_staleness_mean",
    "token_staleness_max",
    "token_stale_share",
    "token_kv_unverified_share",
    "republished_share",
    "steps_done",
    "steps_wall_s",
    "staleness_max",
    "accuracy_before",
    "accuracy_after",
    "samples_per_s_ratio",
    "tokens_per_s_ratio",
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
    "trainer_duty_cycle",
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
    "train_seconds",
    "warmup_steps",
    "heldout_prompts",
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
    "modes",
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


def test_each_mode_is_a_variant_of_ups_spec_and_reports_the_workers_resolved_concurrency(tmp_path, monkeypatch):
    monkeypatch.setenv("CENTERLINE_WORKER_CONCURRENCY", "3")
    flags = ["--task", "copy", "--steps", "50", "--workers", "2", "--trainer-ranks", "1", "--prompts-per-step", "4"]
    flags += ["--rollout-n", "2", "--sglang-args=--log-level debug", "--model-dir", str(tmp_path / "models")]
    base = parse(flags, BENCH_DEFAULTS)
    spec = mode_spec(base, "on-policy", tmp_path / "on-policy")
    up, trainer = spec.up, spec.trainer
    assert (up.task, up.workers, up.trainer_ranks, up.model_dir, up.run_dir) == (
        "copy",
        2,
        1,
        tmp_path / "models",
        tmp_path / "on-policy",
    )
    # the bench's defaults where no flag says otherwise: the same training time for each mode
    assert (
        trainer.steps,
        trainer.heldout_every,
        trainer.prompts_per_step,
        trainer.train_seconds,
        up.heldout_prompts,
    ) == (
        50,
        50,
        4,
        60.0,
        50,
    )
    assert up.sglang_args == "--log-level debug --enable-metrics"
    assert (spec.cfg.training.max_inflight_steps, spec.cfg.rollout.n) == (1, 2)
    assert concurrent_requests(spec) == 2 * 3  # the workers' concurrency as they resolve it, not its default 8
    # `centerline up --config FILE` of the variant's file runs exactly the variant.
    spec.write(tmp_path / "on-policy.toml")
    monkeypatch.delenv("CENTERLINE_WORKER_CONCURRENCY")
    assert parse(["--config", str(tmp_path / "on-policy.toml")]) == spec
    # drain and in-flight: both asynchronous, one trainer setting apart
    variants = {mode: mode_spec(base, mode, tmp_path / mode) for mode in ("drain", "in-flight")}
    assert {m: (v.cfg.training.max_inflight_steps, v.trainer.weight_update) for m, v in variants.items()} == {
        "drain": (2, "drain"),
        "in-flight": (2, "retract"),
    }
    assert spec.trainer.weight_update == "retract"
    # --weight-transports: the transport a mode runs on; without it, up's flag (default disk)
    assert spec.trainer.weight_transport == "disk"
    distributed = mode_spec(base, "in-flight", tmp_path / "in-flight-distributed", "distributed")
    assert (distributed.trainer.weight_transport, distributed.trainer.weight_update) == ("distributed", "retract")
    assert distributed.up.run_dir == tmp_path / "in-flight-distributed"
    on_flag = parse([*flags, "--weight-transport", "distributed"], BENCH_DEFAULTS)
    assert mode_spec(on_flag, "drain", tmp_path / "drain").trainer.weight_transport == "distributed"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--weight-transports", "disk,nfs"], "--weight-transports disk,nfs: distinct names from disk, distributed"),
        (["--weight-transports", "disk,disk"], "--weight-transports disk,disk: distinct names from disk, distributed"),
        (["--weight-transports", ","], "--weight-transports ,: distinct names from disk, distributed"),
        (
            ["--weight-transports", "disk,distributed", "--", "--weight-transport", "distributed"],
            "--weight-transport: --weight-transports sets it for each run; give one of the two",
        ),
    ],
)
def test_weight_transports_refuses_unknown_repeated_or_doubly_given_transports(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as refused:
        bench_pipeline(["--run-dir", str(tmp_path / "run"), *flags])
    assert refused.value.code == 2
    assert capsys.readouterr().err.endswith(f"centerline bench pipeline: error: {message}\n")
    assert not (tmp_path / "run").exists()  # refused before any run


def test_staleness_per_token_is_weighted_by_each_steps_trained_tokens():
    steps = [
        {
            "trained_tokens": 30,
            "token_staleness_mean": 1.0,
            "token_staleness_max": 1,
            "token_stale_share": 0.0,
            "token_kv_unverified_share": 1.0,
        },
        {
            "trained_tokens": 10,
            "token_staleness_mean": 0.2,
            "token_staleness_max": 2,
            "token_stale_share": 0.4,
            "token_kv_unverified_share": 0.2,
        },
    ]
    assert token_staleness(steps) == {
        "token_staleness_mean": 0.8,
        "token_staleness_max": 2,
        "token_stale_share": 0.1,
        "token_kv_unverified_share": 0.8,
    }


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


def test_sglang_alone_gets_the_workers_request_as_the_proxy_rewrites_it(tmp_path):
    from centerline.toy.tokenizer import save_tokenizer
    from rollout_worker.worker import Tokenizer, Worker
    from router_proxy.rewrite import Contract, rewrite_body
    from shared.settings import WorkerSettings
    from shared.task import PromptTask

    save_tokenizer(tmp_path)
    dataset = tmp_path / "train.jsonl"
    dataset.write_bytes(b'{"prompt": "up ab=", "answer": "AB"}\n{"prompt": "up cd=", "answer": "CD"}\n')
    cfg = Config(
        rollout_n=4, rollout_top_k=8, rollout_top_p=0.9, rollout_temperature=0.7, rollout_logprobs_mode="support"
    )
    bodies = request_bodies(cfg, str(tmp_path), dataset)
    worker = Worker(cfg, WorkerSettings(worker_id="w", vocab_size=260), Tokenizer(None, None))
    task = PromptTask(task_id="t/0/0", group_id="g", prompt="up ab=", answer="AB", reward="exact", n=4, step=0)
    ids = orjson.loads(bodies[0])["input_ids"]
    assert len(bodies) == 2 and ids
    assert bodies[0] == rewrite_body(
        orjson.dumps(worker.request_body(task, ids)), "generate", Contract.from_config(cfg)
    )
    assert orjson.loads(bodies[0])["sampling_params"]["top_k"] == 8


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
        "--train-seconds",
        str(TRAIN_S),
        "--warmup-steps",
        str(WARMUP),
        "--workers",
        "1",
        "--trainer-ranks",
        "1",
        "--prompts-per-step",
        str(PROMPTS),
        "--heldout-prompts",
        "2",
        "--model-dir",
        str(tmp_path / "models"),
        "--run-dir",
        str(tmp_path / "run"),
        "--out",
        str(tmp_path / "pipeline.json"),
        "--alone-warmup",
        "1",
        "--alone-seconds",
        str(ALONE_S),
        "--modes",
        "in-flight",  # one mode: each costs a whole `up` run (~45 s here); mode_spec's test covers the others
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
    assert set(r) == SETTING_KEYS | ALONE_KEYS
    written = json.loads((tmp_path / "pipeline.json").read_text())
    assert {k: v for k, v in written.items() if k not in ("command", "commit", "machine", "digest")} == r
    assert (r["steps"], r["warmup_steps"], r["rollout_n"], r["rollout_max_new_tokens"]) == (STEPS, WARMUP, N, MAX_NEW)
    assert r["train_seconds"] == TRAIN_S
    assert r["concurrent_requests"] == 1 * 8  # one worker, eight tasks in flight (the worker's default)
    assert r["model"] == str(tmp_path / "models" / "sft-copy-seed0")
    assert list(r["modes"]) == ["in-flight"]
    m = r["modes"]["in-flight"]
    assert set(m) == PIPELINE_KEYS
    assert m["max_inflight_steps"] == 2 and WARMUP < m["steps_done"] < STEPS
    assert m["weight_update"] == "retract"
    assert (m["weight_transport"], m["weight_fallbacks"]) == ("disk", 0)
    run_dir = tmp_path / "run" / "in-flight"
    steps = [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, m["steps_done"] + 1))
    # the time limit ends training: the last step began before it, and up evaluated after it
    assert sum(s["step_s"] for s in steps[:-1]) < TRAIN_S
    assert m["steps_wall_s"] == round(sum(s["step_s"] for s in steps), 3)
    assert f"--train-seconds {TRAIN_S:g} have passed" in (run_dir / "logs" / "trainer.log").read_text()
    evals = [orjson.loads(line) for line in (run_dir / "heldout_metrics.jsonl").read_bytes().splitlines()]
    assert [e["step"] for e in evals] == [0, m["steps_done"]]
    # in flight, a response's first tokens may be sampled before an update and trained two versions
    # later, which max_staleness (2) still admits
    assert 0 <= m["staleness_max"] <= 2
    assert 0 <= m["token_staleness_mean"] <= m["token_staleness_max"] <= m["staleness_max"]
    assert (m["token_stale_share"] > 0) == (m["token_staleness_max"] > 1)
    window = steps[WARMUP:]
    assert m["weights_s_mean"] == round(sum(s["weights_s"] for s in window) / len(window), 4)
    assert m["weights_s_max"] == round(max(s["weights_s"] for s in window), 4)
    run_config = (run_dir / "config.toml").read_text()
    assert 'weight_update = "retract"' in run_config
    assert 0 <= m["accuracy_before"] <= 1 and 0 <= m["accuracy_after"] <= 1
    # Every step trains prompts x n samples; the window leaves out the warm-up steps.
    done = m["steps_done"]
    assert m["samples_total"] == done * PROMPTS * N
    assert (m["pipeline_steps"], m["pipeline_samples"]) == (done - WARMUP, (done - WARMUP) * PROMPTS * N)
    assert m["pipeline_samples"] <= m["pipeline_tokens"] <= MAX_NEW * m["pipeline_samples"]
    assert m["pipeline_samples_per_s"] == pytest.approx(m["pipeline_samples"] / m["pipeline_window_s"], rel=1e-3)
    assert m["pipeline_tokens_per_s"] == pytest.approx(m["pipeline_tokens"] / m["pipeline_window_s"], rel=1e-3)
    assert m["samples_per_s_ratio"] == round(m["pipeline_samples_per_s"] / r["sglang_alone_samples_per_s"], 4)
    assert m["tokens_per_s_ratio"] == round(m["pipeline_tokens_per_s"] / r["sglang_alone_tokens_per_s"], 4)
    assert 0 <= m["duty_cycle"] <= 1
    assert 0 < m["duty_cycle_window_s"] <= m["pipeline_window_s"]
    assert 0 < m["duty_cycle_error_bound"] < 1
    busy = 1 - sum(s["gather_s"] for s in steps[WARMUP:]) / sum(s["step_s"] for s in steps[WARMUP:])
    assert m["trainer_duty_cycle"] == round(busy, 4)
    # SGLang alone: n samples per request.
    assert r["sglang_alone_samples"] == N * r["sglang_alone_requests"] > 0
    assert r["sglang_alone_samples"] <= r["sglang_alone_tokens"] <= MAX_NEW * r["sglang_alone_samples"]
    assert r["sglang_alone_window_s"] == ALONE_S
    assert 0 <= r["sglang_alone_duty_cycle"] <= 1
    assert 0 < r["sglang_alone_duty_cycle_window_s"] <= r["sglang_alone_window_s"]
    assert 0 < r["sglang_alone_duty_cycle_error_bound"] < 1


def test_the_held_out_figure_is_the_accuracy_or_for_sessions_the_reward():
    assert heldout_key({"step": 0, "heldout_accuracy": 0.2}) == "heldout_accuracy"
    assert heldout_key({"step": 0, "heldout_reward": 0.66}) == "heldout_reward"

"""Every trained token was sampled by the weights its label names: a finished `centerline up` run
teacher-forced through SGLang serving each labelled version (centerline/runs/teacher_force.py,
docs/design.md section 8)."""

import subprocess
import sys
from dataclasses import replace

import numpy as np
import orjson
import pytest

from centerline.runs import teacher_force
from centerline.synth import make_batch
from tests.conftest import ROOT

STEPS = 8
# The chain model's warm start, a third of its default (centerline/toy/sft.py DEFAULT_STEPS), in a
# model directory of its own: its held-out reward is still above 0 (`centerline init-model --sft
# --task chain --sft-steps 100 --eval`), so groups' rewards differ and the steps move the weights,
# which the wrong-label check below asserts; the default's 300 steps were most of this test's time.
SFT_STEPS = 100


def test_labelled_picks_each_samples_sampled_tokens_of_one_version():
    batch = make_batch(samples=2, tokens_per_sample=4, k=4, vocab_size=32)
    batch = replace(
        batch,
        token_versions=np.array([0, 0, 1, 1, 1, 1, 1, 1], np.int32),
        loss_mask=np.array([1, 0, 1, 1, 1, 1, 0, 1], np.uint8),
        weight_version=1,
    )
    [first] = teacher_force.labelled([batch], 0)
    assert first.positions.tolist() == [0]  # the untrained token of version 0 is not checked
    prompt = batch.prompt_ids[batch.prompt_offsets[0] : batch.prompt_offsets[1]].tolist()
    assert first.ids == prompt + batch.response_ids[:4].tolist() and first.prompt_len == len(prompt)
    assert first.recorded.tolist() == batch.sampled_logprobs[:1].tolist()
    assert [s.positions.tolist() for s in teacher_force.labelled([batch], 1)] == [[2, 3], [0, 1, 3]]
    assert teacher_force.labelled([batch], 2) == []


def test_a_summary_counts_the_tokens_beyond_the_tolerance():
    diff = np.array([0.0, 1e-6, 2e-3, 0.5])
    assert teacher_force.summary(diff, 1e-3) == {
        "tokens": 4,
        "beyond": 2,
        "share": 0.5,
        "median": float(np.median(diff)),
        "p99": float(np.quantile(diff, 0.99)),
        "max": 0.5,
    }
    assert teacher_force.summary(np.zeros(0), 1e-3) == {"tokens": 0, "beyond": 0, "share": 0.0}


def test_a_directory_that_is_no_run_is_refused_naming_what_is_missing(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "centerline", "teacher-force", str(tmp_path)], capture_output=True, text=True, cwd=ROOT
    )
    assert run.returncode == 2
    assert run.stderr == (
        f"centerline teacher-force: {tmp_path / 'config.toml'} does not exist: give the run directory of a "
        "finished `centerline up`\n"
    )


def test_a_run_sampled_at_another_temperature_is_refused_by_name(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "config.toml").write_text(f'rollout_temperature = 0.7\n[trainer]\nmodel = "{tmp_path / "model"}"\n')
    with pytest.raises(teacher_force.TeacherForceError, match="rollout_temperature 0.7"):
        teacher_force.check_run(tmp_path)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(900)  # a few minutes alone on 2 cores; a full suite beside it slows it down
def test_every_token_of_a_run_of_sessions_in_flight_is_sampled_by_the_version_its_label_names(tmp_path, sglang):
    """A short run of the chain task's sessions in flight, every service real, under the default
    weight update and the distributed weight transport (the disk one, the default, is the shared
    run's below): each sampled token whose labelled version is still on disk (0, the last three) is
    forced through SGLang serving that version, and its recorded log-prob is the forced one to
    float rounding (prefill against decode: 5e-5, docs/sglang.md), far inside the 1e-3 tolerance.
    The same tokens under the neighbouring version show that the check tells versions apart."""
    transport = "distributed"
    run_dir = tmp_path / "run"
    argv = [
        *("--task", "chain", "--steps", str(STEPS), "--workers", "1", "--trainer-ranks", "1", "--engines", "1"),
        *("--prompts-per-step", "4", "--rollout-n", "4", "--learning-rate", "3e-4"),
        *(
            "--heldout-prompts",
            "4",
            "--heldout-every",
            "100",
            "--model-dir",
            str(tmp_path / "models"),
            "--sft-steps",
            str(SFT_STEPS),
            "--run-dir",
            str(run_dir),
        ),
        *("--weight-transport", transport),
    ]
    up = subprocess.run([sys.executable, "-m", "centerline", "up", *argv], capture_output=True, text=True, cwd=ROOT)
    assert up.returncode == 0, up.stderr[-4000:]
    steps = [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]
    assert len(steps) == STEPS
    assert max(s["version"] for s in steps) == STEPS  # weights moved every step, in flight

    report = teacher_force.check_run(run_dir, sglang.url)
    total = report["total"]
    assert total["tokens"] >= 100, report  # versions 0 and the last ones: a few hundred sampled tokens
    assert len(report["versions"]) >= 2, report  # the initial weights and at least one trained version
    # a wrong label is seen: at this learning rate a step moves many tokens' log-probs by more than 1e-3
    wrong = report["wrong_label"]["total"]
    assert wrong["tokens"] == total["tokens"] and wrong["share"] > 0.1, report
    assert total["beyond"] == 0 and total["max"] < 1e-4, report
    # and the weight update vouches for every label, by construction
    assert [s["token_kv_unverified_share"] for s in steps] == [0.0] * STEPS
    # every version reached the engine by the transport asked for, and its checksum proved it
    assert [(s["weights_verified"], s["weight_mismatches"], s["weight_fallbacks"]) for s in steps] == [
        (1, 0, 0)
    ] * STEPS


@pytest.mark.integration
@pytest.mark.slow
def test_every_token_of_the_shared_run_is_sampled_by_the_version_its_label_names(up_run, sglang):
    """The shared run (tests/conftest.py ``up_run``: weights by disk, the default; two workers, a
    two-rank trainer, every version on disk): each trained token's recorded log-prob is the one
    SGLang gives it under the version its label names, and every version's checksum was proven."""
    steps = [orjson.loads(line) for line in (up_run.run_dir / "metrics.jsonl").read_bytes().splitlines()]
    assert [(s["weights_verified"], s["weight_mismatches"], s["weight_fallbacks"]) for s in steps] == [(1, 0, 0)] * 3
    report = teacher_force.check_run(up_run.run_dir, sglang.url)
    total = report["total"]
    assert total["tokens"] >= 50 and len(report["versions"]) >= 2 and report["skipped_tokens"] == 0, report
    assert total["beyond"] == 0 and total["max"] < 1e-4, report
    assert report["wrong_label"]["total"]["tokens"] == total["tokens"], report

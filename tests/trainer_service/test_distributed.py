"""The same global batch on 1 process and on 2 gloo processes under torchrun gives the same
update, and a step whose loss is not finite on one rank's shard changes nothing on either rank.
Runs `python -m tests.trainer_service.one_step` (``train_step``) for real; each launch takes a few seconds, so a test
launches once for the steps it compares where it can."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from centerline.ports import free_port
from shared.wire import encode_batch
from tests.rounding import REORDER64_TOLERANCE
from tests.trainer_service.conftest import global_batch

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def out_dir(tmp: Path, batch_files: list[Path], nproc: int, *extra: str) -> Path:
    """Where ``run_steps`` of these arguments writes the model."""
    return tmp / f"out-{nproc}-{'-'.join(extra) or 'ddp'}-{'-'.join(f.stem for f in batch_files)}"


def run_steps(tmp: Path, model_dir: str, batch_files: list[Path], nproc: int, *extra: str) -> tuple[dict, list[dict]]:
    """The model after a step on each of ``batch_files`` in turn, and each step's metrics."""
    out = out_dir(tmp, batch_files, nproc, *extra)
    metrics = out.with_suffix(".json")
    cmd = [
        str(TORCHRUN),
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "tests.trainer_service.one_step",
        "--model",
        model_dir,
        *(arg for f in batch_files for arg in ("--batch", str(f))),
        "--out",
        str(out),
        "--metrics",
        str(metrics),
        "--lr",
        "1e-3",
        "--dtype",
        "float64",
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))  # same thread count on 1 and 2 ranks
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return load_file(out / "model.safetensors"), json.loads(metrics.read_text())


def run_steps_saving_each(
    tmp: Path, model_dir: str, batch_files: list[Path], nproc: int, *extra: str
) -> tuple[list[dict], list[dict]]:
    """``run_steps`` with the model saved after every step (``one_step --save-each``): the model
    after each of ``batch_files`` in turn, and each step's metrics, from one launch."""
    last, metrics = run_steps(tmp, model_dir, batch_files, nproc, *extra, "--save-each")
    out = out_dir(tmp, batch_files, nproc, *extra, "--save-each")
    models = [load_file(out / f"step-{i}" / "model.safetensors") for i in range(1, len(batch_files) + 1)]
    assert [k for k in last if not torch.equal(models[-1][k], last[k])] == []  # the last step's is the final model
    return models, metrics


def assert_same_update(before, one, two):
    assert one.keys() == two.keys() == before.keys()
    worst = max(float((one[k] - two[k]).abs().max()) for k in one)
    moved = max(float((one[k] - before[k]).abs().max()) for k in one)
    assert moved > 1e-4  # the step did change the parameters (AdamW lr 1e-3)
    assert worst <= REORDER64_TOLERANCE, worst


def assert_same_metrics(one, two):
    assert one.keys() == two.keys()
    for key in one:
        assert two[key] == pytest.approx(one[key], rel=0, abs=REORDER64_TOLERANCE), key


@pytest.fixture(scope="module")
def one_process_adamw(setup) -> tuple[dict, list[dict]]:
    """The one-process AdamW step (ddp, the default strategy) that the 2-rank ddp and fsdp2 steps
    are both compared with: launched once for the tests of a worker."""
    tmp, model_dir, batch_file, _ = setup
    return run_steps(tmp, model_dir, [batch_file], 1, "--optimizer", "adamw")


@pytest.mark.integration
@pytest.mark.parametrize("optimizer", ("adamw", "sgd"))
def test_two_gloo_ranks_update_like_one_process(setup, optimizer, request):
    tmp, model_dir, batch_file, before = setup
    if optimizer == "adamw":
        one, [m1] = request.getfixturevalue("one_process_adamw")
    else:
        one, [m1] = run_steps(tmp, model_dir, [batch_file], 1, "--optimizer", optimizer)
    two, [m2] = run_steps(tmp, model_dir, [batch_file], 2, "--optimizer", optimizer)
    assert_same_update(before, one, two)
    assert_same_metrics(m1, m2)
    assert m1["trained_tokens"] == 25 and m1["samples"] == 5


@pytest.mark.integration
def test_fsdp2_on_two_gloo_ranks_updates_like_one_process(setup, one_process_adamw):
    tmp, model_dir, batch_file, before = setup
    one, [m1] = one_process_adamw
    two, [m2] = run_steps(tmp, model_dir, [batch_file], 2, "--strategy", "fsdp2", "--optimizer", "adamw")
    assert_same_update(before, one, two)
    assert_same_metrics(m1, m2)


@pytest.mark.integration
@pytest.mark.parametrize("strategy", ("ddp", "fsdp2"))
def test_a_step_not_finite_on_one_ranks_shard_is_skipped_on_both_and_the_next_batch_trains(setup, strategy):
    # Sample 4 is rank 0's (samples 0, 2, 4: shared/batch_algebra.py): its advantage 3e38 makes that
    # rank's loss inf (in float32; in float64 no float32 advantage overflows), rank 1's stays finite;
    # both skip the step, and the good batch after it trains as on a fresh model (docs/design.md section 6).
    tmp, model_dir, batch_file, before = setup
    batch = global_batch(samples=5)
    advantages = np.array(batch.advantages)
    advantages[4] = 3e38
    poison = tmp / "poison.bin"
    poison.write_bytes(encode_batch(replace(batch, advantages=advantages)))
    float32 = ("--strategy", strategy, "--dtype", "float32")
    # one launch of both steps, the model saved after each: after the poison step, then after the good one
    (after_poison, after_both), steps = run_steps_saving_each(tmp, model_dir, [poison, batch_file], 2, *float32)
    good_only, [good] = run_steps(tmp, model_dir, [batch_file], 2, *float32)
    assert [k for k in before if not torch.equal(after_poison[k], before[k])] == []
    assert steps[0]["step_skipped_nonfinite"] == 1 and not math.isfinite(steps[0]["loss"])
    assert steps[1] == good and good["step_skipped_nonfinite"] == 0
    assert [k for k in before if not torch.equal(after_both[k], good_only[k])] == []
    assert all(bool(torch.isfinite(t).all()) for t in after_both.values())
    assert any(not torch.equal(good_only[k], before[k]) for k in before)

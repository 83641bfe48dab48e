"""The same global batch on 1 process and on 2 gloo processes under torchrun gives the same
update, and a step whose loss is not finite on one rank's shard changes nothing on either rank.
Runs `python -m tests.trainer_service.one_step` (``train_step``) for real; each launch takes a few seconds."""

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


def run_steps(tmp: Path, model_dir: str, batch_files: list[Path], nproc: int, *extra: str) -> tuple[dict, list[dict]]:
    """The model after a step on each of ``batch_files`` in turn, and each step's metrics."""
    out = tmp / f"out-{nproc}-{'-'.join(extra) or 'ddp'}-{'-'.join(f.stem for f in batch_files)}"
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


@pytest.mark.integration
@pytest.mark.parametrize("optimizer", ("adamw", "sgd"))
def test_two_gloo_ranks_update_like_one_process(setup, optimizer):
    tmp, model_dir, batch_file, before = setup
    one, [m1] = run_steps(tmp, model_dir, [batch_file], 1, "--optimizer", optimizer)
    two, [m2] = run_steps(tmp, model_dir, [batch_file], 2, "--optimizer", optimizer)
    assert_same_update(before, one, two)
    assert_same_metrics(m1, m2)
    assert m1["trained_tokens"] == 25 and m1["samples"] == 5


@pytest.mark.integration
def test_fsdp2_on_two_gloo_ranks_updates_like_one_process(setup):
    tmp, model_dir, batch_file, before = setup
    one, [m1] = run_steps(tmp, model_dir, [batch_file], 1, "--strategy", "ddp", "--optimizer", "adamw")
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
    after_poison, [skipped] = run_steps(tmp, model_dir, [poison], 2, *float32)
    after_both, steps = run_steps(tmp, model_dir, [poison, batch_file], 2, *float32)
    good_only, [good] = run_steps(tmp, model_dir, [batch_file], 2, *float32)
    assert [k for k in before if not torch.equal(after_poison[k], before[k])] == []
    assert skipped["step_skipped_nonfinite"] == 1 and not math.isfinite(skipped["loss"])
    assert steps[0]["step_skipped_nonfinite"] == 1 and steps[1] == good and good["step_skipped_nonfinite"] == 0
    assert [k for k in before if not torch.equal(after_both[k], good_only[k])] == []
    assert all(bool(torch.isfinite(t).all()) for t in after_both.values())
    assert any(not torch.equal(good_only[k], before[k]) for k in before)

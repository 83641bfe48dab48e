"""A step whose loss or total gradient norm is not finite changes nothing (docs/design.md section 6).

Advantages are user code, and a huge finite one passes the contract: 3e38 makes the loss inf or
NaN, 1e20 keeps the loss finite and overflows the gradient norm. Trained, such a step once wrote
NaN weights into the checkpoint, and every later step failed on them, restarts included. Here,
in one process, and `centerline replay --train` over a recorded segment that holds such a batch.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import orjson
import pytest
import torch
from safetensors.torch import load_file

from centerline.synth import make_batch
from shared.config import Config
from shared.contract import check_batch
from shared.wire import Batch
from tests.trainer_service.conftest import VOCAB, global_batch
from tests.trainer_service.replayed import replay_recorded
from trainer_service.model import load_model
from trainer_service.step import LossSettings, make_optimizer, train_step

K, SAMPLES = 8, 4
CFG = Config(rollout_top_logprobs_num=K, rollout_n=SAMPLES)


def huge(batch, advantage: float):
    """``batch`` with its advantages scaled so the largest magnitude is ``advantage``."""
    scaled = batch.advantages / np.abs(batch.advantages).max() * advantage
    return replace(batch, advantages=scaled.astype(np.float32))


def valid(batch_id: str) -> Batch:
    return make_batch(samples=SAMPLES, tokens_per_sample=5, k=K, vocab_size=VOCAB, batch_id=batch_id, prompt_len=4)


def parameters(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("loss", ["score_centering", "reinforce"])
@pytest.mark.parametrize("advantage, loss_finite", [(3e38, False), (1e20, True)])
def test_a_nonfinite_step_leaves_the_weights_bit_identical_and_the_next_batch_trains(
    tiny_model_dir, loss, advantage, loss_finite
):
    good = global_batch()
    bad = huge(good, advantage)
    check_batch(bad, vocab_size=VOCAB)  # the contract cannot know a reward's scale
    settings = LossSettings(loss=loss)
    model = load_model(tiny_model_dir)
    optimizer = make_optimizer(model, "adamw", 1e-3)
    before = parameters(model)

    skipped = train_step(model, optimizer, bad, settings)

    after = parameters(model)
    assert [name for name in before if not torch.equal(after[name], before[name])] == []
    assert all(bool(torch.isfinite(p).all()) for p in after.values())
    assert optimizer.state_dict()["state"] == {}  # AdamW's moments and step count untouched
    assert (skipped["step_skipped_nonfinite"], math.isfinite(skipped["loss"])) == (1, loss_finite)
    assert not math.isfinite(skipped["grad_norm"])

    trained = train_step(model, optimizer, good, settings)

    reference = load_model(tiny_model_dir)
    expected = train_step(reference, make_optimizer(reference, "adamw", 1e-3), good, settings)
    assert trained == expected and trained["step_skipped_nonfinite"] == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    assert any(not torch.equal(p.detach(), before[name]) for name, p in model.named_parameters())


@pytest.mark.integration
def test_replaying_a_recorded_batch_of_huge_advantages_skips_its_step_and_trains_the_next(tmp_path, tiny_model_dir):
    bad, good = huge(valid("poison"), 3e38), valid("good")
    replay, start = replay_recorded(
        tmp_path, tiny_model_dir, [bad, good], k=K, learning_rate=CFG.training.learning_rate
    )
    assert replay.returncode == 0, replay.stderr[-3000:]
    assert "step 1 skipped: its loss (nan) or total gradient norm (nan) is not finite" in replay.stderr
    assert "batches ['poison']" in replay.stderr
    lines = [orjson.loads(s) for s in (tmp_path / "replayed" / "metrics.jsonl").read_bytes().splitlines()]
    assert [(s["step"], s["batch_ids"], s["step_skipped_nonfinite"], s["loss"]) for s in lines] == [
        (1, ["poison"], 1, None),  # JSON has no NaN: orjson writes null
        (2, ["good"], 0, lines[1]["loss"]),
    ]
    assert math.isfinite(lines[1]["loss"]) and lines[1]["trained_tokens"] == 20
    weights = {
        step: load_file(tmp_path / "replayed" / "checkpoints" / f"step-{step:06d}" / "model" / "model.safetensors")
        for step in (1, 2)
    }
    initial = load_file(start / "model" / "model.safetensors")
    assert all(torch.equal(weights[1][name], initial[name]) for name in initial)
    assert all(bool(torch.isfinite(t).all()) for t in weights[2].values())
    assert any(not torch.equal(weights[2][name], initial[name]) for name in initial)

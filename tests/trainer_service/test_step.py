"""trainer_service.step in one process: the step's gradient is the loss on the whole batch."""

from __future__ import annotations

import pytest
import torch

from tests.trainer_service.conftest import global_batch
from trainer_service.loss import score_centering_loss
from trainer_service.model import load_model
from trainer_service.step import LossSettings, make_optimizer, sample_inputs, shard, train_step


@pytest.mark.parametrize("num_samples, world", [(5, 2), (7, 3), (4, 4), (9, 1)])
def test_shard_gives_each_sample_to_exactly_one_rank(num_samples, world):
    blocks = [shard(num_samples, r, world) for r in range(world)]
    assert [i for b in blocks for i in b] == list(range(num_samples))
    assert max(map(len, blocks)) - min(map(len, blocks)) <= 1


def test_shard_rejects_fewer_samples_than_ranks():
    with pytest.raises(ValueError, match="3 samples for 4 ranks"):
        shard(3, 0, 4)


def test_advantages_are_broadcast_to_every_token_of_their_sample():
    batch = global_batch()
    x = sample_inputs(batch, 2, "cpu")
    assert torch.equal(x["advantages"], torch.full((6,), float(batch.advantages[2])))
    assert x["input_ids"].shape == (1, 4 + 6)


@pytest.mark.parametrize("mode", ("selected", "support"))
def test_step_update_is_minus_the_whole_batch_loss_gradient(tiny_model_dir, mode):
    # SGD with lr = 1 and no clipping: the update is exactly -grad of the loss on all tokens.
    batch = global_batch(mode=mode)
    model = load_model(tiny_model_dir)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    metrics = train_step(
        model, make_optimizer(model, "sgd", 1.0), batch, LossSettings(is_mode="tis"), max_grad_norm=None
    )

    reference = load_model(tiny_model_dir)
    parts = [sample_inputs(batch, i, "cpu") for i in range(batch.num_samples)]
    logits = torch.cat([reference(input_ids=x["input_ids"]).logits[0, x["prompt_len"] - 1 : -1] for x in parts])
    cat = {
        key: torch.cat([x[key] for x in parts])
        for key in ("response_ids", "sampled_logprobs", "cand_ids", "cand_logprobs", "advantages", "loss_mask")
    }
    loss, ref_metrics = score_centering_loss(logits, **cat, mode=mode, is_mode="tis")
    loss.backward()
    # float32 sums in a different order (per sample vs all at once): ~1e-7 relative.
    assert metrics["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    assert metrics["trained_tokens"] == int(batch.loss_mask.sum()) == 25
    for key, value in ref_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in reference.parameters()))
    assert metrics["grad_norm"] == pytest.approx(float(grad_norm), rel=1e-5) and float(grad_norm) > 1e-3
    for name, p in reference.named_parameters():
        update = dict(model.named_parameters())[name].detach() - before[name]
        assert torch.allclose(update, -p.grad, rtol=0, atol=1e-6), name

"""The memory settings of a step (trainer_service.step.Memory, docs/design.md section 6,
Memory): packed micro-batches, activation checkpointing, bfloat16 autocast, the LM head
computed chunk by chunk from hidden states, tied embeddings included."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from shared.settings import TrainerSettings
from tests.rounding import REORDER64_TOLERANCE
from tests.trainer_service.conftest import global_batch, save_tiny_llama
from tests.trainer_service.test_step import ragged_batch
from trainer_service.loss import LOSSES
from trainer_service.model import load_model
from trainer_service.step import (
    LossSettings,
    Memory,
    make_optimizer,
    micro_batch_inputs,
    micro_batches,
    prepare_model,
    response_logits,
    train_step,
)


def test_packed_micro_batches_count_tokens_without_padding():
    # Sample sizes (prompt + response): 5, 7, 8, 11, 14. 5+7+8 = 20; 11+14 = 25 > 20.
    runs = micro_batches(ragged_batch(), range(5), 20, packed=True)
    assert runs == [range(0, 3), range(3, 4), range(4, 5)]
    assert micro_batches(ragged_batch(), range(5), 45, packed=True) == [range(0, 5)]
    assert micro_batches(ragged_batch(), range(5), 1, packed=True) == [range(i, i + 1) for i in range(5)]


def test_packed_inputs_put_samples_end_to_end_with_positions_from_zero_in_each():
    batch = ragged_batch()
    x = micro_batch_inputs(batch, range(0, 2), "cpu", packed=True)
    p0, p1 = batch.prompt_ids[:3].tolist(), batch.prompt_ids[3:4].tolist()
    r0, r1 = batch.response_ids[:2].tolist(), batch.response_ids[2:8].tolist()
    assert x.input_ids.tolist() == [p0 + r0 + p1 + r1]
    assert x.attention_mask is None
    assert x.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]]
    # Position 2 predicts r0[0]; sample 1 starts at 5, its prompt's last token (5) predicts r1[0].
    assert x.positions.tolist() == [2, 3, 5, 6, 7, 8, 9, 10]
    assert x.responses.tolist() == [[True] * 8]
    assert x.rows.response_ids.tolist() == r0 + r1


def test_one_packed_sample_needs_no_position_ids():
    x = micro_batch_inputs(ragged_batch(), range(3, 4), "cpu", packed=True)
    assert x.position_ids is None and x.input_ids.shape == (1, 2 + 9)


def step(model_dir, batch, memory, dtype=torch.float64, model=None):
    """One SGD step at lr 1 without clipping; returns metrics and each parameter's gradient."""
    model = prepare_model(model or load_model(model_dir, dtype=dtype), memory)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    metrics = train_step(
        model,
        make_optimizer(model, "sgd", 1.0),
        batch,
        LossSettings(is_mode="tis"),
        max_grad_norm=None,
        micro_batch_tokens=20,
        memory=memory,
    )
    return metrics, {k: before[k] - v.detach() for k, v in model.named_parameters()}


@pytest.mark.parametrize("packed", (True, False))
def test_activation_checkpointing_gives_identical_gradients(tiny_model_dir, packed):
    batch = ragged_batch()
    plain, grads = step(tiny_model_dir, batch, Memory(packed=packed))
    ckpt, ckpt_grads = step(tiny_model_dir, batch, Memory(packed=packed, activation_checkpointing=True))
    assert ckpt["loss"] == plain["loss"] and ckpt["grad_norm"] == plain["grad_norm"]
    for name, g in grads.items():
        assert torch.equal(ckpt_grads[name], g), name


def test_a_bfloat16_step_keeps_float32_weights_and_is_close_to_float32(tiny_model_dir):
    batch = ragged_batch()
    full, grads = step(tiny_model_dir, batch, Memory(), dtype=torch.float32)
    model = load_model(tiny_model_dir, dtype=torch.float32)
    half, half_grads = step(tiny_model_dir, batch, Memory(dtype="bfloat16"), model=model)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # bfloat16 keeps 8 bits of mantissa: relative rounding 2^-8 per product, a few % over a layer.
    assert half["loss"] == pytest.approx(full["loss"], rel=2e-2)
    assert half["grad_norm"] == pytest.approx(full["grad_norm"], rel=5e-2)
    for name, g in grads.items():
        assert float((half_grads[name] - g).norm()) <= 0.1 * float(g.norm()) + 1e-6, name
    assert half["loss"] != full["loss"]  # autocast did run the model in bfloat16


def test_the_loss_chunk_size_does_not_change_the_step(tiny_model_dir):
    batch = global_batch()
    one, grads = step(tiny_model_dir, batch, Memory(loss_chunk_tokens=1))
    many, many_grads = step(tiny_model_dir, batch, Memory(loss_chunk_tokens=7))
    assert many["loss"] == pytest.approx(one["loss"], rel=0, abs=REORDER64_TOLERANCE)
    for name, g in grads.items():
        assert torch.allclose(many_grads[name], g, rtol=0, atol=REORDER64_TOLERANCE), name


@pytest.mark.parametrize("packed", (True, False))
def test_tied_embeddings_get_the_dense_logits_gradient(tmp_path, packed):
    model_dir = save_tiny_llama(tmp_path / "tied", seed=1, tied=True)
    batch = ragged_batch()
    model = load_model(model_dir, dtype=torch.float64)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    metrics, updates = step(model_dir, batch, Memory(packed=packed), model=model)
    # The dense path: logits [N, V] held whole, the same loss on them, one micro-batch of all samples.
    reference = load_model(model_dir, dtype=torch.float64)
    x = micro_batch_inputs(batch, range(5), "cpu", packed=packed)
    rows = replace(x.rows, token_count=int(x.rows.loss_mask.sum()))
    loss, _ = LOSSES["score_centering"](response_logits(reference, x), rows, LossSettings(is_mode="tis"))
    loss.backward()
    assert metrics["loss"] == pytest.approx(float(loss.detach()), rel=0, abs=REORDER64_TOLERANCE)
    for name, p in reference.named_parameters():
        assert torch.allclose(updates[name], p.grad, rtol=0, atol=REORDER64_TOLERANCE), name


def test_an_unknown_dtype_is_refused_naming_the_setting(tiny_model_dir):
    with pytest.raises(ValueError, match=r"dtype='float16'; expected one of \('float32', 'bfloat16'\) \(--dtype\)"):
        prepare_model(load_model(tiny_model_dir), Memory(dtype="float16"))


def test_the_trainer_settings_give_the_step_its_memory_settings():
    settings = TrainerSettings(
        dtype="bfloat16", activation_checkpointing=True, loss_chunk_tokens=64, pack_samples=False
    )
    assert Memory.from_settings(settings) == Memory("bfloat16", True, 64, False)
    assert Memory.from_settings(TrainerSettings()) == Memory()

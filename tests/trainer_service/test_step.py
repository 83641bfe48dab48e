"""trainer_service.step in one process: the step's gradient is the loss on the whole batch,
however its samples are cut into micro-batches, padded or packed."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from shared.contract import check_batch
from tests.rounding import REORDER64_TOLERANCE
from tests.trainer_service.cases import score_centering_loss
from tests.trainer_service.conftest import VOCAB, global_batch
from trainer_service.model import load_model
from trainer_service.step import (
    LossSettings,
    Memory,
    make_optimizer,
    micro_batch_inputs,
    micro_batches,
    train_step,
)

PROMPT_LENS = [3, 1, 5, 2, 4]
RESPONSE_LENS = [2, 6, 3, 9, 10]


def ragged_batch(mode: str = "selected"):
    """``global_batch``'s 30 rows regrouped into 5 samples of different prompt and response lengths."""
    batch = global_batch(samples=5, tokens_per_sample=6, mode=mode)
    prompts = np.random.default_rng(7).integers(0, VOCAB, sum(PROMPT_LENS)).astype(batch.prompt_ids.dtype)
    return replace(
        batch,
        offsets=np.concatenate([[0], np.cumsum(RESPONSE_LENS)]).astype(batch.offsets.dtype),
        prompt_offsets=np.concatenate([[0], np.cumsum(PROMPT_LENS)]).astype(batch.prompt_offsets.dtype),
        prompt_ids=prompts,
    )


@pytest.mark.parametrize(
    "samples, budget, runs",
    [
        (range(5), 1, [range(0, 1), range(1, 2), range(2, 3), range(3, 4), range(4, 5)]),
        # 1x(3+2)=5, 2x(3+6)=18, then 3x(5+6)=33 > 20; 1x(5+3)=8, 2x(5+9)=28 > 20; ...
        (range(5), 20, [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]),
        (range(5), 4096, [range(0, 5)]),
        (range(2, 5), 30, [range(2, 4), range(4, 5)]),  # a rank's shard: 2x(5+9)=28, 3x(5+10)=45 > 30
        (range(3, 3), 4096, []),
    ],
)
def test_micro_batches_are_runs_of_consecutive_samples_within_the_padded_budget(samples, budget, runs):
    assert micro_batches(ragged_batch(), samples, budget) == runs


def test_micro_batch_inputs_left_pad_prompts_right_pad_responses_and_keep_the_rows_in_order():
    batch = ragged_batch()
    x = micro_batch_inputs(batch, range(0, 2), "cpu")
    p0, p1 = batch.prompt_ids[:3].tolist(), batch.prompt_ids[3:4].tolist()
    r0, r1 = batch.response_ids[:2].tolist(), batch.response_ids[2:8].tolist()
    assert x.input_ids.tolist() == [p0 + r0 + [0] * 4, [0, 0] + p1 + r1]
    assert x.attention_mask.tolist() == [[1] * 5 + [0] * 4, [0, 0] + [1] * 7]
    assert x.position_ids.tolist() == [[0, 1, 2, 3, 4, 4, 4, 4, 4], [0, 0, 0, 1, 2, 3, 4, 5, 6]]
    assert x.responses.tolist() == [[True] * 2 + [False] * 4, [True] * 6]
    assert x.rows.response_ids.tolist() == r0 + r1
    a0, a1 = float(batch.advantages[0]), float(batch.advantages[1])
    assert x.rows.advantages.tolist() == [a0] * 2 + [a1] * 6
    assert x.rows.loss_mask.tolist() == batch.loss_mask[:8].astype(bool).tolist()
    assert (x.rows.mode, x.rows.temperature, x.rows.token_count) == (batch.mode, batch.temperature, None)


def test_micro_batch_inputs_of_equal_prompts_need_no_mask():
    x = micro_batch_inputs(global_batch(), range(0, 5), "cpu")
    assert x.attention_mask is None and x.position_ids is None and x.input_ids.shape == (5, 4 + 6)


def test_an_empty_prompt_is_refused_with_its_sample_id():
    batch = ragged_batch()
    batch = replace(batch, prompt_offsets=np.array([0, 0, 1, 6, 8, 12], dtype=batch.prompt_offsets.dtype))
    with pytest.raises(ValueError, match=f"sample {batch.sample_ids[0]!r} has an empty prompt"):
        micro_batch_inputs(batch, range(0, 2), "cpu")


def reference_inputs(batch, i: int) -> tuple[torch.Tensor, int, dict]:
    """Sample ``i`` alone, as the oracle below runs it: its tokens, prompt length and loss inputs."""
    rows = batch.sample_slice(i)
    prompt = batch.prompt_ids[int(batch.prompt_offsets[i]) : int(batch.prompt_offsets[i + 1])]
    ids = torch.as_tensor(np.concatenate([prompt, batch.response_ids[rows]]), dtype=torch.int64)[None]
    n = rows.stop - rows.start
    loss_inputs = {
        "response_ids": torch.as_tensor(batch.response_ids[rows], dtype=torch.int64),
        "sampled_logprobs": torch.as_tensor(batch.sampled_logprobs[rows], dtype=torch.float32),
        "cand_ids": torch.as_tensor(batch.cand_ids[rows], dtype=torch.int32),
        "cand_logprobs": torch.as_tensor(batch.cand_logprobs[rows], dtype=torch.float32),
        "advantages": torch.full((n,), float(batch.advantages[i])),
        "loss_mask": torch.as_tensor(batch.loss_mask[rows], dtype=torch.bool),
    }
    return ids, len(prompt), loss_inputs


@pytest.mark.parametrize("mode", ["selected", "support"])
def test_the_step_batches_untrained_rows_are_a_sessions_and_pass_the_contract(mode):
    """Loss mask 0 on one row per sample, empty there: the template tokens between a session's turns."""
    batch = global_batch(mode=mode)
    check_batch(batch, vocab_size=VOCAB)
    untrained = batch.loss_mask == 0
    assert untrained.sum() == batch.num_samples and (batch.cand_ids[untrained] == -1).all()


@pytest.mark.parametrize("packed", (True, False))
@pytest.mark.parametrize("micro_batch_tokens", (1, 20, 4096))
@pytest.mark.parametrize(
    "make, mode", [(global_batch, "selected"), (global_batch, "support"), (ragged_batch, "selected")]
)
def test_step_update_is_minus_the_whole_batch_loss_gradient(tiny_model_dir, make, mode, micro_batch_tokens, packed):
    # SGD with lr = 1 and no clipping: the update is exactly -grad of the loss on all tokens,
    # whether each sample runs alone (1), in runs (20) or all in one forward (4096), packed or padded.
    # In float64, so the two sides differ by float64 rounding alone, on any processor.
    batch = make(mode=mode)
    model = load_model(tiny_model_dir, dtype=torch.float64)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    metrics = train_step(
        model,
        make_optimizer(model, "sgd", 1.0),
        batch,
        LossSettings(is_mode="tis"),
        max_grad_norm=None,
        micro_batch_tokens=micro_batch_tokens,
        memory=Memory(packed=packed),
    )

    # The oracle: each sample through the model alone, unpadded, and one loss on all the rows.
    reference = load_model(tiny_model_dir, dtype=torch.float64)
    parts = [reference_inputs(batch, i) for i in range(batch.num_samples)]
    logits = torch.cat([reference(input_ids=ids).logits[0, prompt_len - 1 : -1] for ids, prompt_len, _ in parts])
    cat = {key: torch.cat([x[key] for _, _, x in parts]) for key in parts[0][2]}
    loss, ref_metrics = score_centering_loss(logits, **cat, mode=mode, is_mode="tis")
    loss.backward()
    tolerance = REORDER64_TOLERANCE
    assert metrics["loss"] == pytest.approx(float(loss.detach()), rel=0, abs=tolerance)
    assert metrics["trained_tokens"] == int(batch.loss_mask.sum()) == 25
    for key, value in ref_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=0, abs=tolerance), key
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in reference.parameters()))
    assert metrics["grad_norm"] == pytest.approx(float(grad_norm), rel=0, abs=tolerance) and float(grad_norm) > 1e-3
    for name, p in reference.named_parameters():
        update = dict(model.named_parameters())[name].detach() - before[name]
        assert torch.allclose(update, -p.grad, rtol=0, atol=tolerance), name

"""Each rank's shard of a global batch (``shared/batch_algebra.py``): samples balanced by tokens,
longest first; rank 0 sends each rank its shard only (``trainer_service/distributed.py``), and the
step is the one-process step."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from shared.batch_algebra import assign_shards, select_samples
from shared.wire import encode_batch
from tests.trainer_service.test_distributed import assert_same_metrics, assert_same_update, run_steps
from tests.trainer_service.test_step import PROMPT_LENS, RESPONSE_LENS, ragged_batch

TOKENS = [p + r for p, r in zip(PROMPT_LENS, RESPONSE_LENS)]  # 5, 7, 8, 11, 14


def test_samples_go_longest_first_to_the_rank_with_fewest_tokens():
    batch = ragged_batch()
    assert (np.diff(batch.prompt_offsets) + np.diff(batch.offsets)).tolist() == TOKENS
    # 14 (s4) -> r0; 11 (s3) -> r1; 8 (s2) -> r1 (11 < 14): 19; 7 (s1) -> r0: 21; 5 (s0) -> r1: 24
    assert assign_shards(batch, 2) == [[1, 4], [0, 2, 3]]
    # 14 -> r0, 11 -> r1, 8 -> r2, 7 -> r2 (15), 5 -> r1 (16)
    assert assign_shards(batch, 3) == [[4], [0, 3], [1, 2]]
    assert assign_shards(batch, 1) == [[0, 1, 2, 3, 4]]
    assert assign_shards(batch, 5) == [[4], [3], [2], [1], [0]]


def test_balance_is_by_tokens_not_by_sample_count():
    # one long sample and four short ones: by count 3 + 2, by tokens the long one alone
    batch = ragged_batch()
    lengths = [40, 2, 2, 2, 2]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    rows = np.resize(np.arange(int(batch.num_tokens)), int(offsets[-1]))
    long = replace(
        batch,
        offsets=offsets.astype(np.int64),
        response_ids=batch.response_ids[rows],
        sampled_logprobs=batch.sampled_logprobs[rows],
        loss_mask=batch.loss_mask[rows],
        token_versions=batch.token_versions[rows],
        cand_ids=batch.cand_ids[rows],
        cand_logprobs=batch.cand_logprobs[rows],
    )
    assert assign_shards(long, 2) == [[0], [1, 2, 3, 4]]


def test_rejects_fewer_samples_than_ranks():
    with pytest.raises(ValueError, match="the batch has 5 samples for 6 ranks"):
        assign_shards(ragged_batch(), 6)


def test_a_shard_holds_its_samples_rows_and_prompts_exactly():
    batch = ragged_batch()
    shard = select_samples(batch, [1, 3])
    assert shard.sample_ids == [batch.sample_ids[1], batch.sample_ids[3]]
    rows = np.r_[batch.sample_slice(1), batch.sample_slice(3)]
    for name in ("response_ids", "sampled_logprobs", "loss_mask", "token_versions", "cand_ids", "cand_logprobs"):
        assert np.array_equal(getattr(shard, name), getattr(batch, name)[rows]), name
    assert shard.offsets.tolist() == [0, 6, 15]
    assert shard.prompt_offsets.tolist() == [0, 1, 3]
    assert shard.prompt_ids.tolist() == batch.prompt_ids[3:4].tolist() + batch.prompt_ids[9:11].tolist()
    assert shard.advantages.tolist() == [batch.advantages[1], batch.advantages[3]]
    assert (shard.mode, shard.k, shard.batch_id) == (batch.mode, batch.k, batch.batch_id)


@pytest.mark.integration
@pytest.mark.parametrize("strategy", ("ddp", "fsdp2"))
def test_each_gloo_rank_receives_only_its_shard_and_the_step_is_the_one_process_step(setup, strategy):
    tmp, model_dir, _batch_file, before = setup
    batch = ragged_batch()
    ragged = tmp / "ragged.bin"
    ragged.write_bytes(encode_batch(batch))
    probe = tmp / f"shards-{strategy}"
    two, [m2] = run_steps(tmp, model_dir, [ragged], 2, "--strategy", strategy, "--scatter", "--probe", str(probe))
    one, [m1] = run_steps(tmp, model_dir, [ragged], 1, "--strategy", strategy)
    trained = [json.loads((probe / f"rank-{r}.json").read_text())["trained"] for r in (0, 1)]
    assert trained == [[[batch.sample_ids[i] for i in (1, 4)]], [[batch.sample_ids[i] for i in (0, 2, 3)]]]
    assert_same_update(before, one, two)
    assert_same_metrics(m1, m2)
    assert m2["samples"] == 5 and m2["trained_tokens"] == int(batch.loss_mask.sum())

"""Packing recorded engine responses into wire batches (selected and support mode)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import orjson
import pytest

from rollout_worker.packing import Trajectory, pack_trajectories
from rollout_worker.rewards import group_advantages
from shared.contract import ContractViolation, check_batch
from shared.sampling import Sampling
from shared.task import PromptTask, TaskError
from tests.json_samples import ResponseError, samples_from_response
from tests.rounding import U32

K, VOCAB = 3, 260
TASK = PromptTask(task_id="run/0/7", group_id="run/g7", prompt="up a=", answer="A", reward="exact", n=2, step=0)


def native(tokens, tops=None, support=None, version="3", text="", finish="stop"):
    """A native /generate item as the engine (SGLang 0.5.23) returns it."""
    meta = {
        "id": "x",
        "finish_reason": {"type": finish},
        "weight_version": version,
        "output_token_logprobs": [[lp, t, None] for lp, t in tokens],
    }
    if tops is not None:
        meta["output_top_logprobs"] = [[[lp, t, None] for lp, t in row] for row in tops]
    if support is not None:
        meta["output_token_sampling_mask"] = [[t for _, t in row] for row in support]
        meta["output_token_sampling_logprobs"] = [[lp for lp, _ in row] for row in support]
    return {"text": text, "output_ids": [t for _, t in tokens], "meta_info": meta}


SELECTED = [
    native(
        [(-0.5, 65), (-0.1, 256)],
        tops=[[(-0.5, 65), (-1.5, 66), (-2.5, 67)], [(-0.1, 256), (-3.0, 65), (-4.0, 66)]],
        text="A",
    ),
    native([(-1.5, 66)], tops=[[(-0.5, 65), (-1.5, 66), (-2.5, 67)]], text="B", finish="length"),
]


def pack_responses(task, prompt_ids, samples, rewards, advantages, **settings):
    """A prompt's responses packed as the worker packs them: each a trajectory on ``prompt_ids``."""
    trajectories = [Trajectory.of_sample(prompt_ids, s) for s in samples]
    return pack_trajectories(task, trajectories, rewards, advantages, **settings)


def pack(samples, rewards=(1.0, 0.0), mode="selected"):
    rewards = np.array(rewards)
    return pack_responses(
        TASK,
        [117, 112, 32, 97, 61],
        samples,
        rewards,
        group_advantages(rewards),
        producer="w0",
        sampling=Sampling(
            k=K,
            temperature=1.0,
            top_p=1.0 if mode == "selected" else 0.9,
            top_k=-1 if mode == "selected" else 2,
            mode=mode,
        ),
    )


def test_selected_mode_packs_sampled_tokens_and_top_k_candidates():
    samples = samples_from_response(SELECTED, endpoint="generate", mode="selected", k=K)
    assert [s.text for s in samples] == ["A", "B"] and [s.finish_reason for s in samples] == ["stop", "length"]
    batch = pack(samples)
    check_batch(batch, vocab_size=VOCAB)
    assert batch.batch_id == "run/0/7" and batch.weight_version == 3 and batch.producer == "w0"
    assert batch.sample_ids == ["run/0/7/0", "run/0/7/1"] and batch.group_ids == ["run/g7", "run/g7"]
    assert batch.offsets.tolist() == [0, 2, 3] and batch.response_ids.tolist() == [65, 256, 66]
    np.testing.assert_array_equal(batch.sampled_logprobs, np.float32([-0.5, -0.1, -1.5]))
    assert batch.cand_ids.tolist() == [[65, 66, 67], [256, 65, 66], [65, 66, 67]]
    np.testing.assert_array_equal(batch.cand_logprobs[1], np.float32([-0.1, -3.0, -4.0]))
    assert batch.loss_mask.tolist() == [1, 1, 1]
    assert batch.prompt_offsets.tolist() == [0, 5, 10] and batch.prompt_ids.tolist() == [117, 112, 32, 97, 61] * 2
    assert batch.rewards.tolist() == [1.0, 0.0] and batch.advantages.tolist() == [0.5, -0.5]
    assert (batch.temperature, batch.top_p, batch.top_k, batch.mode, batch.k) == (1.0, 1.0, -1, "selected", K)


def test_support_mode_takes_the_sampled_log_prob_from_the_renormalised_support_row():
    # output_token_logprobs is pre-filter (-0.9); the support row {65: 0.6, 66: 0.4} is what was sampled
    item = native([(-0.9, 65)], support=[[(math.log(0.6), 65), (math.log(0.4), 66)]], text="A")
    other = native([(-1.2, 66)], support=[[(math.log(0.6), 65), (math.log(0.4), 66)]], text="B")
    samples = samples_from_response([item, other], endpoint="generate", mode="support", k=K)
    batch = pack(samples, mode="support")
    check_batch(batch, vocab_size=VOCAB)
    np.testing.assert_allclose(batch.sampled_logprobs, [math.log(0.6), math.log(0.4)], rtol=U32)  # stored as float32
    assert batch.cand_ids.tolist() == [[65, 66, -1], [65, 66, -1]]
    assert batch.cand_logprobs[0, 2] == -np.inf
    assert (batch.top_p, batch.top_k, batch.mode) == (0.9, 2, "support")


def test_a_group_sampled_by_two_weight_versions_is_one_batch_with_each_tokens_version():
    mixed = [SELECTED[0], native([(-1.5, 66)], tops=[[(-0.5, 65), (-1.5, 66), (-2.5, 67)]], version="4", text="B")]
    samples = samples_from_response(mixed, endpoint="generate", mode="selected", k=K)
    batch = pack(samples, rewards=(1.0, 0.0))
    assert (batch.batch_id, batch.task_id, batch.attempt, batch.parts) == ("run/0/7", "run/0/7", 1, 1)
    assert batch.weight_version == 4 and batch.token_versions.tolist() == [3, 3, 4]  # the newest, and per token
    assert batch.sample_ids == ["run/0/7/0", "run/0/7/1"] and batch.advantages.tolist() == [0.5, -0.5]
    check_batch(batch, vocab_size=VOCAB)
    err = pytest.raises(ContractViolation, check_batch, batch, vocab_size=VOCAB, current_version=5, max_staleness=1)
    assert (err.value.rule, err.value.found) == ("stale", 2)  # judged on the oldest trained token, version 3


def test_sglangs_initial_weight_version_default_is_version_0():
    """SGLang reports "default" until an update names a version: it serves its --model-path, the trainer's version 0."""
    initial = native([(-0.5, 65)], tops=[[(-0.5, 65), (-1.5, 66), (-2.5, 67)]], version="default", text="A")
    (sample,) = samples_from_response([initial], endpoint="generate", mode="selected", k=K)
    assert sample.weight_version == 0


def test_a_short_candidate_row_is_left_short_for_the_contract_to_reject():
    short = native([(-0.5, 65)], tops=[[(-0.5, 65), (-1.5, 66)]], text="A")
    samples = samples_from_response([short, SELECTED[1]], endpoint="generate", mode="selected", k=K)
    batch = pack(samples)
    assert batch.cand_ids[0].tolist() == [65, 66, -1]
    with pytest.raises(ContractViolation) as err:
        check_batch(batch, vocab_size=VOCAB)
    assert err.value.rule == "short_row" and (err.value.sample, err.value.row) == (0, 0)


def test_a_missing_top_logprobs_field_packs_as_empty_rows():
    bare = native([(-0.5, 65)], text="A")
    (sample,) = samples_from_response([bare], endpoint="generate", mode="selected", k=K)
    assert sample.cand_ids.tolist() == [[-1, -1, -1]]


@pytest.mark.parametrize(
    "item, message",
    [
        (native([(-0.5, 65)], tops=[[(-0.5, 65), (-1.5, 66), (-2.5, 67), (-3.5, 68)]]), "more than K=3"),
        (native([(-0.5, 65)], tops=[[(-0.5, 65), (-1.5, 66), (-2.5, 67)]], version=None), "weight_version"),
        (
            native([(-0.5, 65)], tops=[[(-0.5, 65), (-1.5, 66), (-2.5, 67)]], version="v1"),
            "'default' or a string of an int",
        ),
        ({"text": "", "meta_info": {"weight_version": "0"}}, "output_token_logprobs"),
        ({"text": ""}, "no meta_info"),
        (native([(-0.5, 65)], tops=[]), "0 rows for 1 output tokens"),
    ],
)
def test_an_unusable_response_raises_response_error_naming_the_field(item, message):
    with pytest.raises(ResponseError, match=message):
        samples_from_response([item], endpoint="generate", mode="selected", k=K)


def test_chat_choices_are_read_from_their_native_meta_info():
    doc = {
        "choices": [
            {"index": i, "message": {"role": "assistant", "content": s["text"]}, "meta_info": s["meta_info"]}
            for i, s in enumerate(SELECTED)
        ]
    }
    samples = samples_from_response(doc, endpoint="chat", mode="selected", k=K)
    assert [s.text for s in samples] == ["A", "B"] and samples[0].response_ids.tolist() == [65, 256]


def test_a_later_attempt_of_a_task_has_its_own_batch_id_so_its_parts_never_mix_with_another_attempts():
    samples = samples_from_response(SELECTED, endpoint="generate", mode="selected", k=K)
    rewards = np.array([1.0, 0.0])
    settings = dict(producer="w0", sampling=Sampling(k=K, temperature=1.0, top_p=1.0, top_k=-1, mode="selected"))
    again = pack_responses(TASK, [117, 112], samples, rewards, group_advantages(rewards), attempt=3, **settings)
    assert (again.batch_id, again.task_id, again.attempt) == ("run/0/7#3", "run/0/7", 3)
    assert again.sample_ids == ["run/0/7/0", "run/0/7/1"]  # the group's samples, whichever attempt


def test_a_task_says_how_many_attempts_came_before_it_and_refuses_a_bad_count():
    again = replace(TASK, attempts_before=2)
    assert PromptTask.from_bytes(again.to_bytes()) == again
    assert PromptTask.from_bytes(orjson.dumps({**orjson.loads(TASK.to_bytes()), "attempts_before": 0})) == TASK
    bad = orjson.dumps({**orjson.loads(TASK.to_bytes()), "attempts_before": -1})
    with pytest.raises(TaskError, match=r"task field 'attempts_before' is -1, expected a whole number >= 0"):
        PromptTask.from_bytes(bad)

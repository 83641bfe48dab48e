"""Reward functions by name and GRPO group advantages."""

from __future__ import annotations

import numpy as np
import pytest

from rollout_worker.rewards import RewardError, group_advantages, load_reward, score
from shared.task import PromptTask


def task(answer="ABC", reward="exact"):
    return PromptTask(task_id="t/0/0", group_id="g", prompt="up abc=", answer=answer, reward=reward, n=2, step=0)


def test_exact_reward_is_one_only_for_the_exact_answer_cut_at_end_of_text():
    exact = load_reward("exact")
    assert exact("ABC", task()) == 1.0
    assert exact("ABC<|endoftext|>junk", task()) == 1.0
    assert exact("ABC ", task()) == 0.0 and exact("AB", task()) == 0.0 and exact("", task()) == 0.0


def test_prefix_reward_is_common_prefix_over_the_longer_string():
    prefix = load_reward("prefix")
    assert prefix("ABC", task()) == 1.0
    assert prefix("ABX", task()) == pytest.approx(2 / 3)
    assert prefix("ABCD", task()) == pytest.approx(3 / 4)
    assert prefix("xyz", task()) == 0.0


def test_a_module_function_reward_is_imported_by_name():
    assert load_reward("shared.rewards:exact") is load_reward("exact")
    assert score(task(reward="shared.rewards:prefix"), ["ABC", "A"]).tolist() == [1.0, pytest.approx(1 / 3)]


@pytest.mark.parametrize("name", ["nope", "shared.rewards:nope", "no_such_module_xyz:f", ":f"])
def test_an_unknown_reward_raises_reward_error(name):
    with pytest.raises(RewardError, match=name.split(":")[-1] or "module:function"):
        load_reward(name)


def test_a_failing_reward_function_raises_reward_error_with_its_name():
    with pytest.raises(RewardError, match="shared.task:PromptTask"):
        score(task(reward="shared.task:PromptTask"), ["ABC"])  # wrong signature: TypeError


def test_grpo_advantages_subtract_the_group_mean():
    assert group_advantages(np.array([1.0, 0.0, 0.0, 1.0])).tolist() == [0.5, -0.5, -0.5, 0.5]
    np.testing.assert_allclose(group_advantages(np.array([1.0, 0.0, 0.0])), [2 / 3, -1 / 3, -1 / 3])
    assert group_advantages(np.array([0.25])).tolist() == [0.0]


def test_grpo_std_normalisation_divides_by_the_population_std_and_keeps_flat_groups_at_zero():
    assert group_advantages(np.array([1.0, 0.0, 0.0, 1.0]), std_norm=True).tolist() == [1.0, -1.0, -1.0, 1.0]
    np.testing.assert_allclose(group_advantages(np.array([3.0, 1.0]), std_norm=True), [1.0, -1.0])
    assert group_advantages(np.array([1.0, 1.0, 1.0]), std_norm=True).tolist() == [0.0, 0.0, 0.0]

"""Rewards that do real work (rollout_worker/rewards.py): async ones awaited, plain ones in a
bounded thread pool, a timeout naming the reward, weighted components each kept by name."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from rollout_worker.rewards import RewardError, Scorer, parse_components, reward_spec, score
from shared.task import PromptTask

M = "tests.rollout_worker.reward_functions"


def task(reward: str) -> PromptTask:
    return PromptTask("t/0/0", "g", "p", "ab", reward, 2, 0)


def test_weighted_components_sum_and_each_is_kept_by_its_name():
    spec = reward_spec([f"{M}:length=1.0", f"{M}:starts_with_answer=0.5", "exact=2"])
    assert spec == f"{M}:length=1.0,{M}:starts_with_answer=0.5,exact=2"
    scores = asyncio.run(Scorer(threads=2).score(task(spec), ["abc", "ab", "x"]))
    assert scores.components == {
        "length": [3.0, 2.0, 1.0],
        "starts_with_answer": [1.0, 1.0, 0.0],
        "exact": [0.0, 1.0, 0.0],
    }
    np.testing.assert_array_equal(scores.total, [3.5, 4.5, 1.0])
    np.testing.assert_array_equal(score(task(spec), ["abc", "ab", "x"]), [3.5, 4.5, 1.0])


def test_one_unweighted_reward_stays_its_name():
    assert reward_spec(["exact"]) == "exact"
    assert reward_spec(["exact=1.0"]) == "exact=1.0"
    assert [c.weight for c in parse_components("exact")] == [1.0]


@pytest.mark.parametrize(
    ("rewards", "message"),
    [
        (["exact=heavy"], "reward 'exact=heavy': weight 'heavy' is not a number; write module:function=0.5"),
        (["exact=inf"], "reward 'exact=inf': weight 'inf' is not finite"),
        (["m:exact=1", "exact=1"], "two components are named 'exact' (a component is named by its function)"),
    ],
)
def test_a_bad_component_is_named_with_the_fix(rewards, message):
    with pytest.raises(RewardError) as err:
        reward_spec(rewards)
    assert message in str(err.value)


@pytest.mark.parametrize("function", ["never_returns", "never_returns_async"])
def test_a_reward_past_its_timeout_fails_naming_it(function):
    with pytest.raises(RewardError) as err:
        asyncio.run(Scorer(threads=1, timeout=0.2).score(task(f"{M}:{function}"), ["x"]))
    assert str(err.value) == (
        f"reward '{M}:{function}' timed out after 0.2s on task 't/0/0'; make it faster or raise worker.reward_timeout"
    )


def test_a_failing_reward_is_named_with_its_error():
    with pytest.raises(
        RewardError, match=rf"reward '{M}:fails' failed on task 't/0/0': RuntimeError: judge unreachable"
    ):
        asyncio.run(Scorer().score(task(f"{M}:fails"), ["x"]))


def test_plain_rewards_run_at_most_threads_at_once():
    """Four calls of a plain reward that each wait for a release: with two threads, two start
    and the other two wait for a free thread (counted, not slept on)."""
    started, release, lock = [], threading.Event(), threading.Lock()
    both = threading.Event()

    def gated(text, t):
        with lock:
            started.append(text)
            if len(started) == 2:
                both.set()
        release.wait(timeout=30)
        return 1.0

    scorer = Scorer(threads=2, timeout=30)

    async def go():
        loop = asyncio.get_running_loop()
        run = asyncio.ensure_future(asyncio.gather(*(scorer._one(c, gated, task("x"), s) for c, s in calls)))
        await loop.run_in_executor(None, both.wait, 30)
        await asyncio.sleep(0)  # let the loop hand the others to the pool if it would
        running = list(started)
        release.set()
        return running, await run

    calls = [(parse_components("exact")[0], s) for s in "abcd"]
    running, values = asyncio.run(go())
    assert len(running) == 2 and values == [1.0, 1.0, 1.0, 1.0]


def test_the_step_logs_each_components_mean_over_its_groups_once_per_task():
    from types import SimpleNamespace

    from centerline.runs.report import render_plots, summary
    from trainer_service.commit import reward_components
    from trainer_service.metrics import scalars

    def part(task_id, **means):
        return SimpleNamespace(task_id=task_id, extra={"reward_components": means})

    parts = [part("a", length=3.0, exact=1.0), part("a", length=3.0, exact=1.0), part("b", length=1.0, exact=0.0)]
    record = {"step": 1, **reward_components([*parts, SimpleNamespace(task_id="c", extra={})])}
    assert record == {"step": 1, "reward_components": {"exact": 0.5, "length": 2.0}}  # a's two parts count once
    assert scalars(record) == {"step": 1.0, "reward_components/exact": 0.5, "reward_components/length": 2.0}
    assert reward_components([SimpleNamespace(task_id="c", extra={})]) == {}  # one reward: no components
    steps = [record, {"step": 2, "reward_components": {"exact": 1.0, "length": 4.0}}]
    assert "reward_components" in render_plots(steps)
    rows = dict(summary(steps))
    assert (rows["reward component exact"], rows["reward component length"]) == ("0.5 → 1", "2 → 4")


def test_up_takes_components_as_repeated_flags_a_toml_list_or_table_and_one_name(tmp_path, monkeypatch):
    from centerline.up.run_spec import parse

    monkeypatch.delenv("CENTERLINE_UP_REWARD", raising=False)

    assert parse(["--reward", "m:f=1.0", "--reward", "m:g=0.5"]).up.reward == ["m:f=1.0", "m:g=0.5"]
    table = tmp_path / "table.toml"
    table.write_text('[up.reward]\n"m:f" = 1.0\n"m:g" = 0.5\n')
    assert parse(["--config", str(table)]).up.reward == ["m:f=1.0", "m:g=0.5"]
    one = tmp_path / "one.toml"
    one.write_text('[up]\nreward = "exact"\n')  # a run's config.toml from before components
    spec = parse(["--config", str(one)])
    assert spec.up.reward == ["exact"] and 'reward = ["exact"]' in spec.to_toml()

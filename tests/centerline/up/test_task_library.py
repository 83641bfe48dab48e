"""reasoning-gym built in (centerline/up/task_library.py): `--dataset reasoning-gym:NAME` generates
the training and held-out rows from the library's generator and scores with its own score_answer,
through `centerline up` end to end."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest
import reasoning_gym

from centerline.up.task_library import REWARD, score_answer
from centerline.up.user_task import UserTaskError, load_library_task
from shared.task import PromptTask
from tests.processes import ENV


def test_rows_are_the_generators_items_and_the_reward_is_its_own_scorer():
    task = load_library_task("reasoning-gym:products", 3, 2, seed=5)
    items = reasoning_gym.create_dataset("products", size=5, seed=5)
    assert [(r.prompt, r.answer) for r in [*task.train, *task.heldout]] == [
        (items[i]["question"], str(items[i]["answer"])) for i in range(5)
    ]
    assert task.heldout_source == (
        "2 more items of reasoning-gym:products (--heldout-prompts), from the generator seeded by --seed 5"
    )
    row = task.train[0]
    prompt = PromptTask("t/0/0", "g", row.prompt, row.answer, REWARD, 1, 0, meta=row.meta)
    assert score_answer(f"<answer>{row.answer}</answer>", prompt) == 1.0
    assert score_answer(f" {row.answer}\n", prompt) == 1.0  # no answer tags: the response stripped
    assert score_answer("12", prompt) == items.score_answer("12", items[0]) == 0.0


def test_a_list_answer_reaches_the_scorer_as_the_generator_made_it():
    task = load_library_task("reasoning-gym:number_sorting", 1, 0, seed=0)
    (row,) = task.train
    items = reasoning_gym.create_dataset("number_sorting", size=1, seed=0)
    prompt = PromptTask("t/0/0", "g", row.prompt, row.answer, REWARD, 1, 0, meta=row.meta)
    assert score_answer(str(items[0]["answer"]), prompt) == items.score_answer(str(items[0]["answer"]), items[0])


def test_an_unknown_task_is_named_with_close_names():
    with pytest.raises(UserTaskError) as err:
        load_library_task("reasoning-gym:leg_count", 3, 2, seed=0)
    assert str(err.value).startswith(
        "--dataset reasoning-gym:leg_count: reasoning-gym has no task 'leg_count'; name one of its"
    )
    assert str(err.value).endswith("tasks, e.g. leg_counting")


@pytest.mark.integration
@pytest.mark.slow
def test_up_trains_a_reasoning_gym_task_scored_by_its_own_scorer(tmp_path, toy_models):
    run_dir = tmp_path / "run"
    flags = ["--dataset", "reasoning-gym:simple_equations", "--dataset-size", "8", "--heldout-prompts", "3"]
    flags += ["--steps", "2", "--workers", "1", "--trainer-ranks", "1", "--prompts-per-step", "2"]
    flags += ["--rollout-n", "2", "--heldout-every", "2", "--model-dir", str(toy_models), "--run-dir", str(run_dir)]
    up = subprocess.run(
        [sys.executable, "-m", "centerline", "up", *flags],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert up.returncode == 0, up.stderr[-4000:]
    rows = [orjson.loads(line) for line in (run_dir / "train.jsonl").read_bytes().splitlines()]
    assert len(rows) == 8 and {r["reward"] for r in rows} == {REWARD}
    assert {r["source_dataset"] for r in rows} == {"simple_equations"}
    assert orjson.loads((run_dir / "heldout.json").read_bytes())["rows"] == 3
    steps = [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and all(s["gate_rejected"] == {} for s in steps)
    evals = [orjson.loads(line) for line in (run_dir / "heldout_metrics.jsonl").read_bytes().splitlines()]
    assert [(e["step"], e["heldout_rows"]) for e in evals] == [(0, 3), (2, 3)]
    assert all(0.0 <= e["heldout_reward"] <= 1.0 for e in evals)
    worker_logs = "".join(p.read_text() for p in (run_dir / "logs").glob("worker*"))
    assert "task rejected" not in worker_logs and "task done" in worker_logs

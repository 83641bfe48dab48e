"""Toy tasks, `centerline dataset`, and the SFT warm start's cache."""

from __future__ import annotations

import json
import re

import orjson
import pytest

from shared.task import PromptTask
from shared.toy_tasks import TASKS, examples, is_heldout
from shared.toy_tasks import main as dataset_main


def solve(prompt: str) -> str:
    """An independent reading of each prompt format."""
    op, arg = re.fullmatch(r"(\w+) (.+)=", prompt).groups()
    if op == "add":
        a, b = arg.split("+")
        return str(int(a) + int(b))
    return {"rev": arg[::-1], "copy": arg, "up": arg.upper()}[op]


@pytest.mark.parametrize("task", sorted(TASKS))
def test_every_toy_example_answers_its_prompt(task):
    for prompt, answer in examples(task, 200, seed=3):
        assert solve(prompt) == answer
        assert prompt.isascii() and 1 <= len(answer) <= 5


@pytest.mark.parametrize("task", sorted(TASKS))
def test_train_and_heldout_splits_are_deterministic_and_disjoint(task):
    train, held = examples(task, 300, seed=0), examples(task, 100, seed=0, split="heldout")
    assert train == examples(task, 300, seed=0) and train != examples(task, 300, seed=1)
    assert all(is_heldout(p) for p, _ in held) and not any(is_heldout(p) for p, _ in train)
    assert not {p for p, _ in train} & {p for p, _ in held}


def test_dataset_command_writes_jsonl_rows_the_trainer_can_turn_into_tasks(tmp_path):
    out = tmp_path / "d.jsonl"
    assert dataset_main(["--task", "reverse", "--n", "5", "--seed", "2", "--out", str(out), "--split", "heldout"]) == 0
    rows = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    assert len(rows) == 5 and rows[0]["id"] == "reverse/heldout/2/0"
    assert [(r["prompt"], r["answer"]) for r in rows] == examples("reverse", 5, 2, "heldout")
    assert {r["reward"] for r in rows} == {"exact"} and {r["split"] for r in rows} == {"heldout"}
    task = PromptTask(
        task_id="run/0/0",
        group_id="g",
        prompt=rows[0]["prompt"],
        answer=rows[0]["answer"],
        reward=rows[0]["reward"],
        n=4,
        step=0,
    )
    assert PromptTask.from_bytes(task.to_bytes()) == task
    again = tmp_path / "e.jsonl"
    dataset_main(["--task", "reverse", "--n", "5", "--seed", "2", "--out", str(again), "--split", "heldout"])
    assert again.read_bytes() == out.read_bytes()


def test_init_model_sft_is_cached_by_its_settings(tmp_path, capsys):
    from centerline.model_init import SETTINGS_FILE
    from centerline.model_init import main as init_main

    out = tmp_path / "m"
    flags = ["--out", str(out), "--sft", "--task", "copy", "--sft-steps", "3"]
    assert init_main(flags) == 0
    weights = (out / "model.safetensors").read_bytes()
    assert json.loads((out / SETTINGS_FILE).read_text())["sft"]["steps"] == 3
    capsys.readouterr()
    assert init_main(flags) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert init_main(["--out", str(out), "--sft", "--task", "copy", "--sft-steps", "4"]) == 0
    assert (out / "model.safetensors").read_bytes() != weights
    assert init_main(flags) == 0  # back to 3 steps: the same bytes as the first time (deterministic)
    assert (out / "model.safetensors").read_bytes() == weights


def test_sft_lowers_the_answer_loss():
    from centerline.model_init import build_model
    from centerline.sft import SftSettings, train

    losses = train(build_model(0), SftSettings(task="upper", steps=30), seed=0)
    assert losses[-1] < 0.6 * losses[0]

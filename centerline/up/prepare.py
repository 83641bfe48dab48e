"""What a ``centerline up`` run trains and evaluates, made before any service starts: the model,
the trainer's dataset and its held-out rows (``prepare``).

The toy task: the model made once by ``init-model --sft`` and cached in ``--model-dir``, a dataset
of ``--dataset-size`` prompts (``centerline dataset``) and ``--heldout-prompts`` held-out prompts scored
by exact match. Your own task (``centerline/up/user_task.py``): ``--model DIR``, the training rows of
``--dataset FILE`` and its held-out rows (``--heldout-dataset``, else the rows marked eval, else none).
A bad row, reward, environment or model fails here, as ``UserTaskError``.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import orjson

from centerline.toy.dataset import CHAT_TASKS, examples
from centerline.up import task_library
from centerline.up.user_task import (
    Keys,
    Row,
    UserTask,
    UserTaskError,
    chat_template_on,
    check_environment,
    check_reward,
    load_library_task,
    load_task,
    write_trainer_dataset,
)
from shared.settings import UpSettings


@dataclass(frozen=True)
class Prepared:
    """What a run trains and evaluates: the model, the trainer's dataset, its held-out rows."""

    model: Path
    dataset: Path
    chat_template: bool  # the workers render each prompt, held-out ones too, with the model's chat template
    heldout: Path | None  # the trainer's heldout_dataset: the held-out rows; None: a user task without any
    user: UserTask | None = None  # None: the toy task
    environment: str = ""  # the toy task's or --environment: its tasks (a user's rows naming none) are sessions


def prepare(up: UpSettings, cfg, run_dir: Path, log) -> Prepared:
    """The model (``--model``, else the toy model made and cached by init-model --sft), the trainer's
    dataset in ``run_dir/train.jsonl`` (``--dataset``'s training rows, else the toy task's) and its
    held-out rows in ``run_dir/heldout.jsonl`` (a user task's, with ``run_dir/heldout.json`` saying
    where they came from, for the report; the toy task's ``--heldout-prompts``, scored by exact match
    whatever ``--reward`` trains: its held-out accuracy); a bad row, reward or model fails here,
    before any service starts."""
    library = up.dataset is not None and task_library.is_library(up.dataset)
    # a task library scores with its own scorer, unless --reward names another
    rewards = [task_library.REWARD] if library and up.reward == ["exact"] else up.reward
    reward = check_reward(rewards)  # as the workers will load it: the one string each task carries
    environment = up.environment or ("" if up.dataset is not None else CHAT_TASKS.get(up.task, ""))
    if environment:
        check_environment(environment)
    owner = next((t for t, e in CHAT_TASKS.items() if e == environment), None)  # a built-in's own toy task
    if owner is not None and up.dataset is None and up.task != owner:
        raise UserTaskError(
            f"--environment {environment}: the built-in environment plays the toy task {owner}, not --task "
            f"{up.task}; add --task {owner}"
        )
    user = None
    if up.dataset is not None:
        if library:
            user = load_library_task(
                up.dataset, up.dataset_size, up.heldout_prompts, cfg.training.seed, up.heldout_dataset
            )
        else:
            user = load_task(up.dataset, up.heldout_dataset, Keys.of(up))
        log(f"dataset {up.dataset}: {len(user.train)} training rows; held-out rows: {user.heldout_source}")
        for number, row in enumerate([*user.train, *user.heldout], 1):
            if row.environment:
                check_environment(row.environment, f"{up.dataset} (row {number}'s environment)")
    if up.model is not None:
        model = up.model
        if not (model / "config.json").is_file():
            raise UserTaskError(
                f"--model {model}: no config.json there; give an HF model directory (`centerline make-model smollm2 "
                f"--out {model}` makes one)"
            )
        log(f"run directory {run_dir}; model {model}")
    else:
        model = up.model_dir / f"sft-{up.task}-seed{cfg.training.seed}"
        log(f"run directory {run_dir}; model {model} (made once, then cached)")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "centerline",
                "init-model",
                "--sft",
                "--task",
                up.task,
                "--seed",
                str(cfg.training.seed),
                "--sft-steps",
                str(up.sft_steps),
                "--out",
                str(model),
            ],
            check=True,
        )
    chat_rows = str(up.dataset) if user is not None and any(r.messages for r in [*user.train, *user.heldout]) else ""
    chat = chat_template_on(up.chat_template, model, toy=up.model is None, chat_rows=chat_rows)
    dataset, heldout = run_dir / "train.jsonl", run_dir / "heldout.jsonl"
    if user is not None:
        write_trainer_dataset(user.train, reward, dataset, environment)
        (run_dir / "heldout.json").write_bytes(
            orjson.dumps({"rows": len(user.heldout), "source": user.heldout_source, "reward": reward})
        )
        if not user.heldout:
            return Prepared(model, dataset, chat, None, user, environment)
        write_trainer_dataset(user.heldout, reward, heldout, environment)
        return Prepared(model, dataset, chat, heldout, user, environment)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "centerline",
            "dataset",
            "--task",
            up.task,
            "--n",
            str(up.dataset_size),
            "--seed",
            str(cfg.training.seed),
            "--reward",
            reward,
            "--environment",
            environment,
            "--out",
            str(dataset),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    rows = [
        Row(prompt, answer) for prompt, answer in examples(up.task, up.heldout_prompts, cfg.training.seed, "heldout")
    ]
    # a session's reward is its environment's; a single-turn toy task's held-out figure is exact match
    write_trainer_dataset(rows, reward if environment else "exact", heldout, environment)
    return Prepared(model, dataset, chat, heldout, environment=environment)

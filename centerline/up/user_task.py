"""A user's own task for `centerline up`: dataset rows, held-out rows, reward, chat template.

A dataset is JSONL, one object per line:

    {"prompt": "What is 2+3?", "answer": "5"}
    {"prompt": "What is 7+1?", "answer": "8", "meta": {"source": "drill"}, "split": "eval"}

``prompt`` and ``answer`` are strings (the prompt not empty); ``meta`` is an optional object handed
to the reward function as ``task.meta``, and any other key of the row (an ``id``, say) joins it
there; ``split`` is optional, ``"train"`` (the default) or ``"eval"``: a row marked ``eval`` is
held out, never trained on; ``environment`` is optional, ``"module:function"``: the row is a
multi-turn session of that environment (``--environment`` is the default of rows that name
none). ``reward`` is not a row's: ``--reward`` scores every row. The held-out rows are
``--eval-dataset``'s (every row of that file) when it is given, else the rows the dataset marks
``eval``, else none; the held-out figure is the mean reward of one sample per held-out row (a
row with an environment: of one session of it, the reward it returns).

The reward is ``--reward``: a built-in (``exact``, ``prefix``) or ``module:function``, importable
from the directory `centerline up` runs in, called as ``reward(response_text, task) -> float``
(``rollout_worker/rewards.py``): ``task.prompt``, ``task.answer`` and ``task.meta`` are the row's,
the text is the response with its stop token (the model's eos, ``<|im_end|>`` for a ChatML model)
already cut off. An environment (``--environment``, a row's ``environment``) is loaded the same
way, and must be ``async def environment(client, task) -> float`` (``rollout_worker/environment.py``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import orjson

FIELDS = ("prompt", "answer", "meta", "split", "environment")
SPLITS = ("train", "eval")
TRAINER_KEYS = ("prompt", "answer", "reward")  # a trainer dataset row's own keys; meta keys sit beside them


class UserTaskError(ValueError):
    """A dataset, reward or model the run cannot start with; the message names the file, line, field and fix."""


@dataclass(frozen=True)
class Row:
    prompt: str
    answer: str
    meta: dict = field(default_factory=dict)
    split: str = "train"
    environment: str = ""  # "module:function": the row runs as sessions of it; "" the run's --environment


def load_rows(path: Path) -> list[Row]:
    """Every row of the JSONL file ``path``, checked; blank lines are skipped."""
    try:
        lines = Path(path).read_bytes().splitlines()
    except OSError as exc:
        raise UserTaskError(f"dataset {path}: cannot be read ({exc.strerror}); give an existing JSONL file") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            rows.append(_row(line, f"{path}:{number}"))
    if not rows:
        raise UserTaskError(f"dataset {path}: holds no rows; write one JSON object per line with prompt and answer")
    return rows


def _row(line: bytes, where: str) -> Row:
    try:
        doc = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise UserTaskError(f"{where}: not JSON ({exc}); write one JSON object per line") from None
    if not isinstance(doc, dict):
        raise UserTaskError(f"{where}: a row is {type(doc).__name__}, expected a JSON object with prompt and answer")
    if "reward" in doc:
        raise UserTaskError(f"{where}: field 'reward' is {doc['reward']!r}; --reward scores every row, drop the field")
    for name in ("prompt", "answer"):
        if not isinstance(doc.get(name), str):
            raise UserTaskError(
                f"{where}: field {name!r} is {doc.get(name)!r}, expected a string (every row needs prompt and answer)"
            )
    if not doc["prompt"]:
        raise UserTaskError(f"{where}: field 'prompt' is empty; give the text the model answers")
    meta = doc.get("meta", {})
    if not isinstance(meta, dict):
        raise UserTaskError(f"{where}: field 'meta' is {meta!r}, expected a JSON object (or leave it out)")
    extra = {k: v for k, v in doc.items() if k not in FIELDS}
    clash = sorted(set(meta) & (set(extra) | set(TRAINER_KEYS)))
    if clash:
        raise UserTaskError(
            f"{where}: meta holds {', '.join(map(repr, clash))}, also a field of the row; rename it in meta"
        )
    meta = {**meta, **extra}
    split = doc.get("split", "train")
    if split not in SPLITS:
        raise UserTaskError(f"{where}: field 'split' is {split!r}, expected 'train' or 'eval' (or leave it out)")
    environment = doc.get("environment", "")
    if not isinstance(environment, str):
        raise UserTaskError(
            f"{where}: field 'environment' is {environment!r}, expected a string 'module:function' (or leave it out)"
        )
    return Row(doc["prompt"], doc["answer"], meta, split, environment)


@dataclass(frozen=True)
class UserTask:
    """The rows a run trains on and evaluates on, and where the held-out rows came from."""

    train: list[Row]
    heldout: list[Row]
    heldout_source: str  # in words, for the log and the report


def load_task(dataset: Path, eval_dataset: Path | None) -> UserTask:
    rows = load_rows(dataset)
    train = [r for r in rows if r.split == "train"]
    if not train:
        raise UserTaskError(f"dataset {dataset}: every row is marked split 'eval'; leave some rows to train on")
    marked = [r for r in rows if r.split == "eval"]
    if eval_dataset is not None:
        heldout, source = load_rows(eval_dataset), f"every row of --eval-dataset {eval_dataset}"
    elif marked:
        heldout, source = marked, f'the rows of {dataset} marked "split": "eval"'
    else:
        heldout, source = [], f'none: {dataset} marks no row "split": "eval" and --eval-dataset is unset'
    return UserTask(train, heldout, source)


def write_trainer_dataset(rows: list[Row], reward: str, out: Path, environment: str = "") -> None:
    """The trainer's dataset (trainer_service/tasks.py): prompt, answer, reward, the row's environment
    (else ``environment``, when set), the meta keys beside them."""
    with open(out, "wb") as fh:
        for row in rows:
            doc = {"prompt": row.prompt, "answer": row.answer, "reward": reward, **row.meta}
            if row.environment or environment:
                doc["environment"] = row.environment or environment
            fh.write(orjson.dumps(doc) + b"\n")


def check_reward(name: str):
    """The reward function ``name``, loaded as the workers will load it, or ``UserTaskError``."""
    from rollout_worker.rewards import load_reward

    return _check("--reward", name, load_reward)


def check_environment(name: str, where: str = "--environment"):
    """The environment ``name`` (``where``: the flag or the dataset row that names it), loaded as
    the workers will load it, or ``UserTaskError`` naming it, the value and the fix."""
    from rollout_worker.environment import load_environment

    return _check(where, name, load_environment)


def _check(where: str, name: str, load):
    """``load(name)`` as a worker calls it: workers run from this directory, which ``python -m``
    puts on their import path, so it goes on this process's path too."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return load(name)
    except ValueError as exc:  # RewardError, EnvironmentLoadError
        raise UserTaskError(f"{where} {name}: {exc}") from None


def has_chat_template(model: Path) -> bool:
    from transformers import AutoTokenizer

    return bool(AutoTokenizer.from_pretrained(str(model)).chat_template)


def chat_template_on(setting: str, model: Path, toy: bool) -> bool:
    """``--chat-template``: ``auto`` is on for a ``--model`` whose tokenizer has a chat template and
    off for the toy model (its tasks are continuations, not messages); ``on`` needs a template."""
    if setting == "off" or (setting == "auto" and toy):
        return False
    has_template = has_chat_template(model)
    if setting == "on" and not has_template:
        raise UserTaskError(
            f"--chat-template on: the tokenizer of {model} has no chat template; use --chat-template off, or a "
            "model whose tokenizer_config.json or chat_template.jinja holds one"
        )
    return has_template

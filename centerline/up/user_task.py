"""A user's own task for `centerline up`: dataset rows, held-out rows, reward, chat template.

A dataset is JSONL, one object per line, or a table the ``datasets`` library reads (parquet,
arrow, CSV, a ``save_to_disk`` directory: ``centerline/up/dataset_files.py``), one row each:

    {"prompt": "What is 2+3?", "answer": "5"}
    {"prompt": "What is 7+1?", "answer": "8", "meta": {"source": "drill"}, "split": "heldout"}
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}], "answer": "4"}

``prompt`` and ``answer`` are strings (the prompt not empty; in a table, a column typed as numbers is read as its text);
``messages``, instead of ``prompt``, is a chat prompt (a system prompt, several turns, the last
the user's; TRL's ``prompt`` column holding such a list is read so too), rendered by the model's
chat template with the generation prompt (the row's ``prompt`` is then its last message's
content, and ``task.meta["messages"]`` the list); the columns are renamed by
``--dataset-prompt-key``, ``--dataset-answer-key`` and ``--dataset-messages-key``; ``meta`` is an optional object handed
to the reward function as ``task.meta``, and any other key of the row (an ``id``, say) joins it
there; ``split`` is optional, ``"train"`` (the default) or ``"heldout"`` (``"eval"``, the older word, means
the same): a row marked held out is never trained on; ``environment`` is optional, ``"module:function"``: the row is a
multi-turn session of that environment (``--environment`` is the default of rows that name
none). ``reward`` is not a row's: ``--reward`` scores every row. The held-out rows are
``--heldout-dataset``'s (every row of that file) when it is given, else the rows the dataset marks
held out, else a ``DatasetDict``'s ``test`` or ``validation`` split, else none; the held-out
figure is the mean reward of one sample per held-out row (a row with an environment: of one
session of it, the reward it returns).

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

from centerline.up.dataset_files import HELDOUT_SPLITS, DatasetFileError, is_jsonl, read_records

FIELDS = ("prompt", "answer", "meta", "split", "environment", "messages")
HELDOUT_MARKS = ("heldout", "eval")  # a row's "split" that holds it out; "eval" is the older word
SPLITS = ("train", *HELDOUT_MARKS)
TRAINER_KEYS = ("prompt", "answer", "reward", "messages")  # a trainer dataset row's own keys; meta keys beside them
ROLES = ("system", "user", "assistant", "tool")


class UserTaskError(ValueError):
    """A dataset, reward or model the run cannot start with; the message names the file, line, field and fix."""


@dataclass(frozen=True)
class Keys:
    """The columns of a dataset that hold the prompt, the chat messages and the answer
    (``--dataset-prompt-key``, ``--dataset-messages-key``, ``--dataset-answer-key``)."""

    prompt: str = "prompt"
    answer: str = "answer"
    messages: str = "messages"

    @classmethod
    def of(cls, up) -> Keys:
        return cls(up.dataset_prompt_key, up.dataset_answer_key, up.dataset_messages_key)


@dataclass(frozen=True)
class Row:
    prompt: str  # a chat row's: the content of its last user message
    answer: str
    meta: dict = field(default_factory=dict)
    split: str = "train"
    environment: str = ""  # "module:function": the row runs as sessions of it; "" the run's --environment
    messages: tuple = ()  # a chat row's messages, rendered by the model's chat template; () a plain prompt


def load_rows(path: Path, keys: Keys = Keys()) -> list[Row]:
    """Every row of the dataset ``path`` (``centerline/up/dataset_files.py``: JSONL, parquet, a
    save_to_disk directory...), checked."""
    return _load(path, keys)[0]


def _load(path: Path, keys: Keys) -> tuple[list[Row], list[Row] | None]:
    try:
        records, held = read_records(path)
    except DatasetFileError as exc:
        raise UserTaskError(str(exc)) from None
    typed = not is_jsonl(path)  # a table's column types are the reader's guess: a number answer is its text
    rows = [_row(doc, where, keys, typed) for where, doc in records]
    if not rows:
        raise UserTaskError(f"dataset {path}: holds no rows; write one JSON object per line with prompt and answer")
    return rows, None if held is None else [_row(doc, where, keys, typed) for where, doc in held]


def _row(doc: object, where: str, keys: Keys = Keys(), typed: bool = False) -> Row:
    if not isinstance(doc, dict):
        raise UserTaskError(f"{where}: a row is {type(doc).__name__}, expected a JSON object with prompt and answer")
    try:
        doc = {_field(k, keys): v for k, v in doc.items()}
    except UserTaskError as exc:
        raise UserTaskError(f"{where}: {exc}") from None
    if isinstance(doc.get("prompt"), list):  # TRL's conversational form: the prompt column holds the messages
        doc["messages"] = doc.pop("prompt")
    if "reward" in doc:
        raise UserTaskError(f"{where}: field 'reward' is {doc['reward']!r}; --reward scores every row, drop the field")
    messages = _messages(doc, where, keys) if "messages" in doc else ()
    if messages and "prompt" in doc:
        raise UserTaskError(
            f"{where}: the row has both {keys.prompt!r} and {keys.messages!r}; keep one (messages: a chat prompt)"
        )
    if typed and isinstance(doc.get("answer"), int | float) and not isinstance(doc.get("answer"), bool):
        doc["answer"] = str(doc["answer"])  # a column the reader typed as numbers: the reward compares text
    names = ("answer",) if messages else ("prompt", "answer")
    for name in names:
        if not isinstance(doc.get(name), str):
            raise UserTaskError(
                f"{where}: field {_key(name, keys)!r} is {doc.get(name)!r}, expected a string (every row needs "
                f"{_key('prompt', keys)!r} or {keys.messages!r}, and {keys.answer!r}; --dataset-{name}-key names "
                "another column)"
            )
    prompt = messages[-1]["content"] if messages else doc["prompt"]
    if not prompt:
        raise UserTaskError(f"{where}: field {_key('prompt', keys)!r} is empty; give the text the model answers")
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
        raise UserTaskError(f"{where}: field 'split' is {split!r}, expected 'train' or 'heldout' (or leave it out)")
    environment = doc.get("environment", "")
    if not isinstance(environment, str):
        raise UserTaskError(
            f"{where}: field 'environment' is {environment!r}, expected a string 'module:function' (or leave it out)"
        )
    return Row(prompt, doc["answer"], meta, split, environment, messages)


def _field(key: str, keys: Keys) -> str:
    """The row's own name of a dataset column: ``prompt``, ``answer``, ``messages`` by ``keys``."""
    mapped = {keys.prompt: "prompt", keys.answer: "answer", keys.messages: "messages"}
    if key in mapped:
        return mapped[key]
    if key in ("prompt", "answer", "messages"):  # a default name the settings give another column
        raise UserTaskError(
            f"column {key!r} is not the row's {key} (--dataset-{key}-key {getattr(keys, key)}); drop or rename it"
        )
    return key


def _key(name: str, keys: Keys) -> str:
    return getattr(keys, name)


def _messages(doc: dict, where: str, keys: Keys) -> tuple:
    """A chat row's messages, checked: dicts with a role and a string content, the last one the
    user's (or a tool's): the model answers it."""
    messages = doc["messages"]
    fix = "give a list of {'role': 'system' | 'user' | 'assistant' | 'tool', 'content': str}, the last one the user's"
    if not isinstance(messages, list) or not messages:
        raise UserTaskError(f"{where}: field {keys.messages!r} is {messages!r:.120}; {fix}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise UserTaskError(f"{where}: field {keys.messages!r}[{i}] is {message!r:.120}; {fix}")
        message = {k: v for k, v in message.items() if v is not None}  # Arrow fills other messages' keys with None
        if message.get("role") not in ROLES:
            raise UserTaskError(f"{where}: field {keys.messages!r}[{i}] has role {message.get('role')!r}; {fix}")
        if not isinstance(message.get("content"), str):
            raise UserTaskError(
                f"{where}: field {keys.messages!r}[{i}] has content {message.get('content')!r:.120}; {fix}"
            )
        out.append(message)
    if out[-1]["role"] not in ("user", "tool"):
        raise UserTaskError(
            f"{where}: field {keys.messages!r} ends with a message of role {out[-1]['role']!r}; the model answers the "
            "last message: end with the user's (an assistant's reply is what training samples)"
        )
    return tuple(out)


@dataclass(frozen=True)
class UserTask:
    """The rows a run trains on and evaluates on, and where the held-out rows came from."""

    train: list[Row]
    heldout: list[Row]
    heldout_source: str  # in words, for the log and the report


def load_task(dataset: Path, heldout_file: Path | None, keys: Keys = Keys()) -> UserTask:
    rows, split = _load(dataset, keys)
    train = [r for r in rows if r.split == "train"]
    if not train:
        raise UserTaskError(f"dataset {dataset}: every row is marked split 'heldout'; leave some rows to train on")
    marked = [r for r in rows if r.split in HELDOUT_MARKS]
    if heldout_file is not None:
        heldout, source = load_rows(heldout_file, keys), f"every row of --heldout-dataset {heldout_file}"
    elif marked:
        heldout, source = marked, f'the rows of {dataset} marked "split": "heldout" (or "eval")'
    elif split:
        heldout, source = split, f"the held-out split of {dataset} ({' or '.join(HELDOUT_SPLITS)}, the first there)"
    else:
        heldout, source = (
            [],
            f'none: {dataset} marks no row "split": "heldout" (or "eval") and --heldout-dataset is unset',
        )
    return UserTask(train, heldout, source)


def load_library_task(dataset, train: int, heldout: int, seed: int, heldout_file: Path | None = None) -> UserTask:
    """The rows of a built-in task library's task (``centerline/up/task_library.py``): ``train``
    generated rows, and ``heldout`` more held out unless ``heldout_file`` gives the held-out rows."""
    from centerline.up.task_library import TaskLibraryError, generate

    try:
        rows, held = generate(dataset, train, heldout, seed)
    except TaskLibraryError as exc:
        raise UserTaskError(str(exc)) from None
    train_rows = [_row(doc, f"{dataset} item {i}") for i, doc in enumerate(rows)]
    if heldout_file is not None:
        return UserTask(train_rows, load_rows(heldout_file), f"every row of --heldout-dataset {heldout_file}")
    held_rows = [_row(doc, f"{dataset} item {train + i}") for i, doc in enumerate(held)]
    source = f"{heldout} more items of {dataset} (--heldout-prompts), from the generator seeded by --seed {seed}"
    return UserTask(train_rows, held_rows, source)


def write_trainer_dataset(rows: list[Row], reward: str, out: Path, environment: str = "") -> None:
    """The trainer's dataset (trainer_service/tasks.py): prompt, answer, reward, the row's environment
    (else ``environment``, when set), the meta keys beside them."""
    with open(out, "wb") as fh:
        for row in rows:
            doc = {"prompt": row.prompt, "answer": row.answer, "reward": reward, **row.meta}
            if row.messages:  # the worker renders them with the model's chat template (rollout_worker/main.py)
                doc["messages"] = list(row.messages)
            if row.environment or environment:
                doc["environment"] = row.environment or environment
            fh.write(orjson.dumps(doc) + b"\n")


def check_reward(names: str | list[str]) -> str:
    """The reward spec a task carries for ``--reward``'s values (``rollout_worker/rewards.py``: one
    reward, or weighted components), every function loaded as the workers will load it, or
    ``UserTaskError`` naming the flag, the value and the fix."""
    from rollout_worker.rewards import RewardError, load_components, reward_spec

    names = [names] if isinstance(names, str) else list(names)
    try:
        spec = reward_spec(names)
    except RewardError as exc:
        raise UserTaskError(f"--reward {' '.join(names)}: {exc}") from None
    _check("--reward", " ".join(names), lambda _: load_components(spec))
    return spec


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


def chat_template_on(setting: str, model: Path, toy: bool, chat_rows: str = "") -> bool:
    """``--chat-template``: ``auto`` is on for a ``--model`` whose tokenizer has a chat template and
    off for the toy model (its tasks are continuations, not messages); ``on`` needs a template.
    ``chat_rows``: the dataset whose rows hold messages, which only a chat template renders."""
    if chat_rows and setting == "off":
        raise UserTaskError(
            f"--chat-template off: rows of {chat_rows} hold messages, which the model's chat template renders; "
            "drop --chat-template off, or give each row a plain prompt"
        )
    if setting == "off" or (setting == "auto" and toy and not chat_rows):
        return False
    has_template = has_chat_template(model)
    if chat_rows and not has_template:
        raise UserTaskError(
            f"--dataset {chat_rows}: its rows hold messages, and the tokenizer of {model} has no chat template to "
            "render them; give a --model whose tokenizer has one, or plain prompts"
        )
    if setting == "on" and not has_template:
        raise UserTaskError(
            f"--chat-template on: the tokenizer of {model} has no chat template; use --chat-template off, or a "
            "model whose tokenizer_config.json or chat_template.jinja holds one"
        )
    return has_template

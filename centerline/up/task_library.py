"""Task libraries built in: ``--dataset reasoning-gym:NAME`` (``pip install 'centerline[reasoning-gym]'``).

reasoning-gym's procedural generators make the rows, no download: ``--dataset-size`` training rows
and ``--heldout-prompts`` held-out rows of task ``NAME`` (one of the library's ~100, e.g.
``leg_counting``, ``basic_arithmetic``), all from one generator seeded by ``--seed``, the first
ones trained on, the rest held out (a task whose space is small may repeat an item across them).
Each row's prompt is the generator's question, its answer the generator's, and its ``meta`` the
item's ``metadata`` with the task's name (``source_dataset``). The reward, unless ``--reward``
names another, is ``score_answer`` here: the library's own scorer of that task, given the
response's ``<answer>...</answer>`` when it holds one (the format reasoning-gym's system prompt
asks for), else the whole response stripped.
"""

from __future__ import annotations

import functools

PREFIX = "reasoning-gym:"
REWARD = "centerline.up.task_library:score_answer"


class TaskLibraryError(ValueError):
    """A task library or task that cannot be loaded; the message names it and the fix."""


def is_library(dataset) -> bool:
    return str(dataset).startswith(PREFIX)


def _library():
    try:
        import reasoning_gym
    except ImportError:
        raise TaskLibraryError(
            "--dataset reasoning-gym:...: the reasoning-gym package is not installed; pip install "
            "'centerline[reasoning-gym]'"
        ) from None
    return reasoning_gym


def generate(dataset, train: int, heldout: int, seed: int) -> tuple[list[dict], list[dict]]:
    """``(train rows, held-out rows)`` of ``reasoning-gym:NAME``, as dataset rows: prompt, answer, meta."""
    name = str(dataset)[len(PREFIX) :]
    library = _library()
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        close = sorted(n for n in DATASETS if name and (name in n or n in name))[:8] or sorted(DATASETS)[:8]
        raise TaskLibraryError(
            f"--dataset {dataset}: reasoning-gym has no task {name!r}; name one of its {len(DATASETS)} tasks, "
            f"e.g. {', '.join(close)}"
        )
    try:
        items = library.create_dataset(name, size=train + heldout, seed=seed)
    except Exception as exc:  # noqa: BLE001 (the generator's own configuration checks)
        raise TaskLibraryError(
            f"--dataset {dataset}: reasoning-gym cannot make it: {type(exc).__name__}: {exc}"
        ) from None
    rows = [_row(name, items[i]) for i in range(train + heldout)]
    return rows[:train], rows[train:]


def _row(name: str, item: dict) -> dict:
    # the answer as the generator made it (a list, for some tasks), for its scorer; task.answer is its text
    meta = {"source_dataset": name, "metadata": _plain(item.get("metadata", {})), "item_answer": _plain(item["answer"])}
    return {"prompt": item["question"], "answer": str(item["answer"]), "meta": meta}


def _plain(value):
    """``value`` as JSON holds it (tuples as lists, other objects as text): the row travels as JSON."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


@functools.lru_cache(maxsize=32)
def _scorer(name: str):
    return _library().get_score_answer_fn(name)


def score_answer(text: str, task) -> float:
    """The reward of a reasoning-gym row: the library's ``score_answer`` of its task on the
    response's answer (``<answer>...</answer>`` if present, else the response stripped)."""
    from reasoning_gym.utils import extract_answer

    answer = extract_answer(text)
    entry = {
        "question": task.prompt,
        "answer": task.meta.get("item_answer", task.answer),
        "metadata": task.meta.get("metadata", {}),
    }
    return float(_scorer(task.meta["source_dataset"])(answer if answer is not None else text.strip(), entry))

"""The built-in rewards, by the name a task, a dataset row or ``--reward`` gives (``REWARDS``):
``"exact"`` and ``"prefix"``, for any single-turn task whose rows carry an ``answer``; the rollout
worker scores with them (``rollout_worker/rewards.py``) and the settings accept their names.

Each compares the response with ``task.answer`` (``task`` a ``shared.task.PromptTask``). The engine
already cuts a response at its stop token; anything from a literal ``<|endoftext|>`` on is cut here too:

    exact   1.0 if the response equals the answer, else 0.0
    prefix  partial credit: (length of the common prefix) / max(len(answer), len(response))
"""

from __future__ import annotations

EOS_TEXT = "<|endoftext|>"


def response_answer(response: str) -> str:
    """The response up to a literal end-of-text marker (the engine normally strips it already)."""
    cut = response.find(EOS_TEXT)
    return response if cut < 0 else response[:cut]


def exact(response: str, task) -> float:
    """1.0 if the response is exactly the answer, else 0.0. ``task`` is a ``shared.task.PromptTask``."""
    return 1.0 if response_answer(response) == task.answer else 0.0


def prefix(response: str, task) -> float:
    """Partial credit: common-prefix length over the longer of response and answer (1.0 = exact)."""
    got, want = response_answer(response), task.answer
    longest = max(len(got), len(want))
    if longest == 0:
        return 1.0
    same = 0
    for a, b in zip(got, want):
        if a != b:
            break
        same += 1
    return same / longest


REWARDS = {"exact": exact, "prefix": prefix}

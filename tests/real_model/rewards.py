"""Reward functions of the real-model tests, loaded by name (``module:function``) as a user's are."""

from __future__ import annotations


def contains_answer(text: str, task) -> float:
    """1.0 when the response mentions the row's answer (case-insensitive), else 0.0."""
    return 1.0 if task.answer.lower() in text.lower() else 0.0

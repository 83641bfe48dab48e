"""The learning rate of each step (docs/design.md section 6, "Learning rate"): a linear warmup
over ``--lr-warmup-steps``, then ``--learning-rate`` constant or on a cosine down to
``--lr-min-ratio`` of it at step ``--steps``. A function of the step index alone, so a resumed,
retrained or replayed step runs at the rate it ran at first.
"""

from __future__ import annotations

import math


def lr_factor(step: int, *, warmup: int, schedule: str, total: int, min_ratio: float) -> float:
    """The share of the base learning rate at step index ``step`` (0-based)."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    if schedule != "cosine":
        raise ValueError(f"lr_schedule={schedule!r}; expected constant or cosine")
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr

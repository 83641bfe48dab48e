"""Regenerate golden_loss.json: loss, metrics and gradient norms for a fixed seed matrix.

    .venv/bin/python -m tests.trainer_service.make_golden

The figures are computed in float64 from float32 inputs (each case as a float32 batch carries
them), so they hold on every processor to float64 rounding; test_golden.py compares the float32
computation to them within its rounding bound. Commit the result with the change that moved the
numbers, so the review shows them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.trainer_service.cases import LOSSES, in_dtype, make_case

PATH = Path(__file__).with_name("golden_loss.json")


def configurations():
    for mode in ("selected", "support"):
        for is_mode in ("none", "tis", "mis"):
            for temperature in (1.0, 0.7):
                yield {"loss": "score_centering", "mode": mode, "is_mode": is_mode, "temperature": temperature}
    for loss in ("reinforce", "tis"):
        yield {"loss": loss, "mode": "selected", "is_mode": "none", "temperature": 0.7}


def golden_case(config: dict):
    """The float32 inputs of one configuration (a fixed seed, one padded row)."""
    return make_case(100, mode=config["mode"], n=16, vocab=50, k=8, dtype=torch.float32, padded_rows=(3,))


def figures(config: dict, dtype: torch.dtype) -> dict:
    """The configuration's figures with the loss computing in ``dtype``."""
    case = in_dtype(golden_case(config), dtype)
    kwargs = {key: value for key, value in config.items() if key != "loss"}
    loss, metrics = LOSSES[config["loss"]](**case, **kwargs)
    loss.backward()
    grad = case["logits"].grad.double()
    return {
        "loss": float(loss.detach()),
        "grad_norm": float(grad.norm()),
        "grad_abs_sum": float(grad.abs().sum()),
        **metrics,
    }


def compute(dtype: torch.dtype = torch.float64) -> list[dict]:
    return [{"config": config, "figures": figures(config, dtype)} for config in configurations()]


if __name__ == "__main__":
    PATH.write_text(json.dumps(compute(), indent=1) + "\n")
    print(f"wrote {PATH}")

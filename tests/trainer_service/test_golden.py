"""Loss, metrics and gradient norms for a fixed seed matrix equal the committed figures.

The committed figures are float64 (make_golden.py). Each is compared within the rounding bound of
tests/rounding.py for its magnitude, taken from the dense oracle: the float64 computation to
float64's bound (so any change of formula shows, on every processor), the float32 one, as the
trainer runs, to float32's. A numeric change shows up here; regenerate with
`python -m tests.trainer_service.make_golden` and commit golden_loss.json with the change, so the
new numbers are reviewed.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.rounding import sum_tolerance, unit_roundoff
from tests.trainer_service.cases import in_dtype
from tests.trainer_service.make_golden import PATH, compute, configurations, golden_case
from tests.trainer_service.oracle import chain_length, oracle

GOLDEN = json.loads(PATH.read_text())


def reference(config):
    """The dense float64 oracle's figures for a configuration, their magnitudes and chain length."""
    case = in_dtype(golden_case(config), torch.float64)
    value, grad, metrics, mags = oracle(case, **config)
    figures = {"loss": value, "grad_norm": float(grad.norm()), "grad_abs_sum": float(grad.abs().sum()), **metrics}
    return figures, mags, chain_length(case)


def test_the_golden_file_covers_every_configuration():
    assert [g["config"] for g in GOLDEN] == list(configurations())


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32), ids=("float64", "float32"))
def test_loss_figures_equal_the_committed_golden_file(dtype):
    for golden, current in zip(GOLDEN, compute(dtype)):
        assert golden["config"] == current["config"]
        assert golden["figures"].keys() == current["figures"].keys(), golden["config"]
        _, mags, length = reference(golden["config"])
        for key, value in golden["figures"].items():
            tolerance = sum_tolerance(mags[key], length, unit_roundoff(dtype))
            assert abs(current["figures"][key] - value) <= tolerance, (golden["config"], key, current["figures"][key])


def test_the_golden_figures_equal_the_dense_oracle():
    for golden in GOLDEN:
        figures, mags, length = reference(golden["config"])
        assert figures.keys() == golden["figures"].keys()
        for key, ref in figures.items():
            tolerance = sum_tolerance(mags[key], length, unit_roundoff(torch.float64))
            assert abs(golden["figures"][key] - ref) <= tolerance, (golden["config"], key)

"""Loss, metrics and gradient norms for a fixed seed matrix equal the committed figures.

A numeric change shows up here; regenerate with `python -m tests.trainer_service.make_golden`
and commit golden_loss.json with the change, so the new numbers are reviewed.
"""

from __future__ import annotations

import json

import pytest

from tests.trainer_service.make_golden import PATH, compute


def test_loss_figures_equal_the_committed_golden_file():
    golden = json.loads(PATH.read_text())
    current = compute()
    assert [g["config"] for g in golden] == [c["config"] for c in current]
    for g, c in zip(golden, current):
        assert g["figures"].keys() == c["figures"].keys(), g["config"]
        for key, value in g["figures"].items():
            # float32 on the CPU: bit-identical on one machine; 1e-5 absorbs another SIMD width's rounding.
            assert c["figures"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (g["config"], key)

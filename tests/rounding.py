"""Rounding-error bounds for comparing floating-point figures: the one place tests take a tolerance from.

A sum of n terms computed in floating point, in any order (so with any SIMD width, blocking or
split across ranks), differs from the exact sum by at most ``gamma(n - 1, u) * sum |terms|``
(Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., eq. 4.4), where ``u`` is the
unit roundoff of the precision. Two computations of the same figure that each obey the bound differ
by at most twice it. A figure's magnitude (the sum of the absolute values of what it adds up, see
tests/trainer_service/oracle.py) therefore sets its tolerance, never its value: a signed sum
such as ``sc_correction`` can be small while its terms are not (issue 20: -0.0516 from terms of
order 1, off by 6e-7 on AVX2).
"""

from __future__ import annotations

import torch

U32 = 2.0**-24  # float32 unit roundoff
U64 = 2.0**-53  # float64 unit roundoff


def unit_roundoff(dtype: torch.dtype) -> float:
    """The unit roundoff of the precision a loss computes in for logits of ``dtype``
    (float32 for float32 and bfloat16 logits, float64 for float64)."""
    return U64 if dtype == torch.float64 else U32


def gamma(n: int, u: float) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error bound of n chained roundings."""
    assert n * u < 0.5, (n, u)
    return n * u / (1 - n * u)


def sum_tolerance(magnitude: float, n: int, u: float) -> float:
    """Largest difference two order-independent computations of a sum may show: twice Higham's
    bound for ``n`` chained roundings over terms whose absolute values add up to ``magnitude``."""
    return 2 * gamma(n, u) * magnitude


# A training step of the tests' tiny model (tests/trainer_service/conftest.py: 2 layers, width 32,
# vocabulary 64) computed twice in float64 in another order (padded micro-batches, or partial sums
# over ranks). No chain of roundings in it is longer than 2,000 and no figure, gradient entry or
# AdamW update adds terms of total magnitude above 100, so the two differ by at most this (about
# 4.4e-11), far below any real difference (>= 1e-6 there).
REORDER64_TOLERANCE = sum_tolerance(100.0, 2000, U64)

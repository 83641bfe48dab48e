"""The confidence interval of a mean over a few seeds: Student's t, without scipy.

For n values with mean m and sample standard deviation s (n - 1 in the denominator), the
two-sided interval at confidence c is ``m +- t * s / sqrt(n)``, with t the (1 + c) / 2 quantile
of Student's t with n - 1 degrees of freedom. That quantile is found by bisection on the
closed-form t distribution for integer degrees of freedom (Abramowitz and Stegun 26.7.3-4).

An experiment reports each number as ``interval``'s ``{"mean", "low", "high"}`` at
``CONFIDENCE``, written ``0.424 [0.390, 0.460]`` (``format_interval``).
"""

from __future__ import annotations

import math

CONFIDENCE = 0.95
INTERVAL = "mean over seeds and its 95% Student-t interval, mean +- t(0.975, n-1) * sd / sqrt(n)"


def two_sided_mass(t: float, df: int) -> float:
    """P(|T| <= t) for T ~ Student's t with ``df`` (integer >= 1) degrees of freedom: A&S's A(t | df)."""
    theta = math.atan(t / math.sqrt(df))
    cos2 = math.cos(theta) ** 2
    if df % 2 == 0:  # 26.7.4: sin(theta) [1 + 1/2 cos^2 + (1*3)/(2*4) cos^4 + ... + cos^(df-2)]
        term = total = 1.0
        for k in range(2, df, 2):
            term *= cos2 * (k - 1) / k
            total += term
        return math.sin(theta) * total
    # 26.7.3: 2/pi [theta + sin(theta) (cos + 2/3 cos^3 + ... + (2*4...(df-3))/(1*3...(df-2)) cos^(df-2))]
    total = 0.0
    if df > 1:
        term = total = math.cos(theta)
        for k in range(3, df - 1, 2):
            term *= cos2 * (k - 1) / k
            total += term
    return 2 / math.pi * (theta + math.sin(theta) * total)


def t_quantile(confidence: float, df: int) -> float:
    """The t with P(|T| <= t) = ``confidence`` for ``df`` degrees of freedom (4.303 for 0.95 and df 2)."""
    if not 0 < confidence < 1 or df < 1:
        raise ValueError(f"confidence={confidence}, df={df}: need 0 < confidence < 1 and df >= 1")
    low, high = 0.0, 1.0
    while two_sided_mass(high, df) < confidence:
        high *= 2
    for _ in range(200):
        mid = (low + high) / 2
        if two_sided_mass(mid, df) < confidence:
            low = mid
        else:
            high = mid
        if high - low <= 1e-12 * high:
            break
    return (low + high) / 2


def mean_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float | None, float | None]:
    """``(mean, low, high)``: the mean and its two-sided t-interval; ``low`` and ``high`` are None for
    fewer than two values (one seed says nothing about the spread)."""
    n = len(values)
    if n == 0:
        raise ValueError("mean_interval of no values")
    mean = sum(values) / n
    if n < 2:
        return mean, None, None
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(confidence, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def interval(values: list, confidence: float = CONFIDENCE) -> dict | None:
    """``{"mean", "low", "high"}`` of the values that are not None (``low`` and ``high`` None for one
    value); None if there are none."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    mean, low, high = mean_interval(values, confidence)
    return {"mean": mean, "low": low, "high": high}


def format_interval(value: dict | None) -> str:
    """``0.424 [0.390, 0.460]``, the mean alone for one value, ``–`` for none."""
    if value is None:
        return "–"
    if value["low"] is None:
        return f"{value['mean']:.3f}"
    return f"{value['mean']:.3f} [{value['low']:.3f}, {value['high']:.3f}]"

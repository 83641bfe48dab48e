"""The t-interval of a mean over seeds, against closed forms and (where installed) scipy."""

import math

import pytest

from centerline.experiments.interval import format_interval, interval, mean_interval, t_quantile


def test_t_quantile_has_the_closed_forms_of_one_and_two_degrees_of_freedom():
    # df 1 is Cauchy: P(|T| <= t) = 2 atan(t) / pi; df 2: P(|T| <= t) = t / sqrt(2 + t^2)
    assert t_quantile(0.95, 1) == pytest.approx(math.tan(0.95 * math.pi / 2), rel=1e-10)  # 12.7062
    assert t_quantile(0.95, 2) == pytest.approx(0.95 * math.sqrt(2 / (1 - 0.95**2)), rel=1e-10)  # 4.3027


def test_t_quantile_agrees_with_scipy():
    stats = pytest.importorskip("scipy.stats")
    for df in [*range(1, 41), 100, 1000]:
        for confidence in (0.5, 0.9, 0.95, 0.99):
            assert t_quantile(confidence, df) == pytest.approx(stats.t.ppf((1 + confidence) / 2, df), rel=1e-9)


def test_mean_interval_of_three_seeds_is_the_mean_plus_minus_t_times_the_standard_error():
    # mean 2, sample sd 1, n 3: half-width t(0.975, 2) / sqrt(3) = sqrt(2 * 0.9025 / 0.0975 / 3) = 2.4841377
    mean, low, high = mean_interval([1.0, 2.0, 3.0])
    half = math.sqrt(2 * 0.9025 / 0.0975 / 3)
    assert mean == 2.0
    assert (low, high) == pytest.approx((2.0 - half, 2.0 + half), rel=1e-10)
    assert half == pytest.approx(2.4841377, abs=1e-7)


def test_mean_interval_of_one_seed_has_no_interval():
    assert mean_interval([0.4]) == (0.4, None, None)


def test_mean_interval_of_equal_values_is_a_point():
    assert mean_interval([0.25, 0.25, 0.25]) == (0.25, 0.25, 0.25)


def test_interval_leaves_missing_values_out_and_is_none_without_any():
    half = math.sqrt(2 * 0.9025 / 0.0975 / 3)
    assert interval([1.0, None, 2.0, 3.0]) == pytest.approx({"mean": 2.0, "low": 2.0 - half, "high": 2.0 + half})
    assert interval([None, 0.4]) == {"mean": 0.4, "low": None, "high": None}
    assert interval([None]) is None and interval([]) is None


def test_an_interval_is_written_to_three_decimals_the_mean_alone_for_one_seed_a_dash_for_none():
    assert format_interval({"mean": 0.4242, "low": 0.39, "high": 0.46}) == "0.424 [0.390, 0.460]"
    assert format_interval({"mean": 0.4, "low": None, "high": None}) == "0.400"
    assert format_interval(None) == "–"

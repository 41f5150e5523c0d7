"""The paired-seed interval every loss claim carries: mean(d) +- t(0.975, n - 1) sd(d) / sqrt(n)."""

import math

import pytest

from flexdemo.plan.intervals import T_975, paired_interval, t_975


def test_t_quantiles_are_students():
    stats = pytest.importorskip("scipy.stats")
    for df in range(1, len(T_975) + 1):
        assert t_975(df) == pytest.approx(stats.t.ppf(0.975, df), abs=5e-4), df
    assert t_975(100) >= stats.t.ppf(0.975, 100)  # beyond the table: wider, never narrower


def test_interval_from_its_definition():
    d = [0.02, -0.01, 0.04, 0.01]
    mean = sum(d) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 3)
    got = paired_interval(d)
    assert got.n == 4 and got.mean == pytest.approx(mean)
    assert got.high == pytest.approx(mean + 3.182 * sd / 2)
    assert got.low == pytest.approx(mean - 3.182 * sd / 2)
    one = paired_interval([-0.3])
    assert one.high == math.inf and one.low == -math.inf
    with pytest.raises(ValueError):
        paired_interval([])

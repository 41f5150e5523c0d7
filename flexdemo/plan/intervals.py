"""A loss claim's 95% interval over paired seeds: for per-seed differences ``d_i = L_i / A_i - 1``
(a setting's final held-out loss against AdamW's on the same seed), ``mean(d) +- t(0.975, n - 1) x
sd(d) / sqrt(n)``. One seed has no interval (infinitely wide)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

# Student's t, two-sided 95% (the 0.975 quantile), by degrees of freedom; beyond 30 the value at 30
# (at most 2% wider than the true one).
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def t_975(df: int) -> float:
    if df < 1:
        raise ValueError(f"t(0.975, {df}): needs at least one degree of freedom")
    return T_975[min(df, len(T_975)) - 1]


@dataclass(frozen=True)
class Interval:
    mean: float
    half_width: float  # inf with one seed
    n: int

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width

    def text(self) -> str:
        if self.n < 2:
            return f"{self.mean:+.1%} (one seed, no interval)"
        return f"{self.mean:+.1%} [{self.low:+.1%}, {self.high:+.1%}] (95%, {self.n} seeds)"


def paired_interval(differences: Sequence[float]) -> Interval:
    d = [float(x) for x in differences]
    if not d:
        raise ValueError("no seeds")
    mean = statistics.fmean(d)
    if len(d) < 2:
        return Interval(mean, math.inf, 1)
    return Interval(mean, t_975(len(d) - 1) * statistics.stdev(d) / math.sqrt(len(d)), len(d))

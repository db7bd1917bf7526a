"""Statistics of simulated experiments: warm-up truncation (MSER-5), confidence intervals over
seeds (Student t), percentiles. Pure functions, no I/O.

Warm-up rule (MSER-5, White 1997): the series (TTFT of requests in arrival order) is cut into
batches of 5 and their means ``z_1..z_m``; the truncation ``d`` (in batches) minimises
``MSER(d) = sum_{j>d} (z_j - mean(z_{d+1..m}))^2 / (m - d)^2`` over ``0 <= d <= m // 2`` (the
second half is never truncated: a minimum there means the series has no steady state, which
the caller reports). The first ``5 d`` observations are the warm-up.

Confidence interval over ``n`` seeds: ``mean ± t_{0.975, n-1} * s / sqrt(n)`` (``s`` the
sample standard deviation); with one seed the interval is the point itself (unknown width,
reported as such by ``n``).
"""
from __future__ import annotations

import math
from typing import Sequence

# two-sided 95 % Student t quantiles t_{0.975, df}, df = 1..30 (beyond: the normal 1.96 rounded up)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)
MSER_BATCH = 5


def t975(df: int) -> float:
    """Two-sided 95 % Student t quantile for ``df >= 1`` degrees of freedom."""
    if df < 1:
        raise ValueError("t quantile needs df >= 1")
    return _T975[df - 1] if df <= len(_T975) else 2.0


def mean_ci(xs: Sequence[float], level: float = 0.95) -> dict[str, float | int | None]:
    """``{"mean", "lo", "hi", "n"}`` of ``xs`` (None entries dropped); a 95 % t interval.
    Empty input gives None for mean and bounds."""
    if level != 0.95:
        raise ValueError("only 95 % intervals are tabulated")
    v = [float(x) for x in xs if x is not None and not math.isnan(x)]
    n = len(v)
    if n == 0:
        return {"mean": None, "lo": None, "hi": None, "n": 0}
    m = sum(v) / n
    if n == 1:
        return {"mean": m, "lo": m, "hi": m, "n": 1}
    s = math.sqrt(sum((x - m) ** 2 for x in v) / (n - 1))
    h = t975(n - 1) * s / math.sqrt(n)
    return {"mean": m, "lo": m - h, "hi": m + h, "n": n}


def mser5(series: Sequence[float]) -> int:
    """Warm-up length (number of leading observations to drop) by MSER-5 (module docstring).
    Fewer than 2 batches: 0."""
    b = MSER_BATCH
    m = len(series) // b
    if m < 2:
        return 0
    z = [sum(series[j * b:(j + 1) * b]) / b for j in range(m)]
    # suffix sums for O(m) evaluation of every truncation point
    s1 = [0.0] * (m + 1)
    s2 = [0.0] * (m + 1)
    for j in range(m - 1, -1, -1):
        s1[j] = s1[j + 1] + z[j]
        s2[j] = s2[j + 1] + z[j] * z[j]
    best_d, best = 0, math.inf
    for d in range(0, m // 2 + 1):
        k = m - d
        sse = s2[d] - s1[d] * s1[d] / k
        val = sse / (k * k)
        if val < best - 1e-15:
            best_d, best = d, val
    return best_d * b


def pct(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated ``q`` quantile (NaN for no values)."""
    if not xs:
        return float("nan")
    v = sorted(xs)
    k = (len(v) - 1) * q
    f = math.floor(k)
    c = min(len(v) - 1, f + 1)
    return v[f] + (v[c] - v[f]) * (k - f)


def rnd(x: float | None, nd: int = 6) -> float | None:
    """Round for JSON (None for None / NaN / inf)."""
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return None
    return round(float(x), nd)

"""Means with Student-t and Welch 95 % intervals, the statistics every sweep and benchmark summary reports."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from scipy import stats


def interval(values: Sequence[float]) -> dict[str, float]:
    """Mean and Student-t 95 % interval (half-width 0 for one value)."""
    values = [float(v) for v in values if math.isfinite(v)]
    if not values:
        return {"mean": float("nan"), "lo": float("nan"), "hi": float("nan"), "n": 0}
    mean = statistics.fmean(values)
    half = 0.0
    if len(values) > 1:
        half = float(stats.t.ppf(0.975, len(values) - 1)) * statistics.stdev(values) / math.sqrt(len(values))
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "n": len(values)}


def welch_interval(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
    """Mean of `a` minus mean of `b` and its Welch 95 % interval (two samples, unequal variances, not paired)."""
    a, b = [float(x) for x in a if math.isfinite(x)], [float(x) for x in b if math.isfinite(x)]
    if len(a) < 2 or len(b) < 2:
        return {"mean": float("nan"), "lo": float("nan"), "hi": float("nan"), "n": min(len(a), len(b))}
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    diff = statistics.fmean(a) - statistics.fmean(b)
    if va + vb == 0:
        return {"mean": diff, "lo": diff, "hi": diff, "n": min(len(a), len(b))}
    dof = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = float(stats.t.ppf(0.975, dof)) * math.sqrt(va + vb)
    return {"mean": diff, "lo": diff - half, "hi": diff + half, "n": min(len(a), len(b))}


def percent_interval(x: dict[str, float], digits: int = 0) -> str:
    """An :func:`interval` of fractions as percent: ``+12% [+3%, +21%]``."""
    mean, lo, hi = (f"{100 * x[k]:+.{digits}f}%" for k in ("mean", "lo", "hi"))
    return f"{mean} [{lo}, {hi}]"

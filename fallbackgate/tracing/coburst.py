"""Do expert misses and KV misses burst together? Same-cell co-occurrence against independence, and the
lagged cross-correlation of the two per-step miss series, each with a 95 % interval.

A cell is one (step, layer) with any access; it has an expert miss when any of its expert accesses was not
on device before (``tier_before != device``), and likewise for KV. The lift is P(both) / (P(expert) P(KV)):
1 when independent. Its interval is a bootstrap over steps (cells of one step stay together). The
cross-correlation at lag k is corr(expert misses at t, KV misses at t + k) over steps; its interval is the
Fisher-z one with n - |k| pairs.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from fallbackgate.tracing.contention import contention_rows
from fallbackgate.tracing.reader import Trace
from fallbackgate.tracing.results import Analysis, AnalysisResult, AnalysisRow
from fallbackgate.tracing.schema import TraceTable

Z95 = 1.959963984540054


def miss_cells(trace: Trace) -> pd.DataFrame:
    """One row per (step, layer) cell with any access: columns step, layer, expert_miss, kv_miss (bool)."""
    parts = []
    for table, name in ((TraceTable.EXPERT_ACCESS, "expert_miss"), (TraceTable.KV_ACCESS, "kv_miss")):
        frame = trace.frame(table)[["step", "layer", "tier_before"]]
        frame[name] = frame["tier_before"].astype(str) != "device"
        parts.append(frame.groupby(["step", "layer"])[name].any())
    cells = pd.concat(parts, axis=1).fillna(False).astype(bool)
    return cells.reset_index()


def _lift_per_step(cells: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Per step: [cells, expert misses, KV misses, both] counts, and the steps."""
    cells = cells.assign(both=cells["expert_miss"] & cells["kv_miss"], one=1)
    per_step = cells.groupby("step")[["one", "expert_miss", "kv_miss", "both"]].sum()
    return per_step.to_numpy(np.float64), per_step.index.to_numpy()


def _lift(counts: np.ndarray) -> np.ndarray:
    """Lift from summed [..., 4] counts."""
    n, e, k, both = (counts[..., i] for i in range(4))
    with np.errstate(divide="ignore", invalid="ignore"):
        return (both / n) / ((e / n) * (k / n))


def cross_correlation(x: np.ndarray, y: np.ndarray, max_lag: int) -> list[tuple[int, float, float, float]]:
    """(lag, r, low, high) of corr(x_t, y_{t+lag}) for lag in -max_lag..max_lag (Fisher-z 95 % intervals)."""
    out = []
    for lag in range(-max_lag, max_lag + 1):
        a, b = (x[: len(x) - lag], y[lag:]) if lag >= 0 else (x[-lag:], y[: len(y) + lag])
        if len(a) < 4 or a.std() == 0 or b.std() == 0:
            out.append((lag, float("nan"), float("nan"), float("nan")))
            continue
        r = float(np.corrcoef(a, b)[0, 1])
        half = Z95 / np.sqrt(len(a) - 3)
        z = np.arctanh(np.clip(r, -0.999999, 0.999999))
        out.append((lag, r, float(np.tanh(z - half)), float(np.tanh(z + half))))
    return out


def co_burst(trace: Trace, max_lag: int = 8, num_resamples: int = 400, seed: int = 0) -> AnalysisResult:
    """Same-cell lift with a bootstrap interval, and the lagged cross-correlation with its peak."""
    result = AnalysisResult(Analysis.CO_BURST)
    cells = miss_cells(trace)
    if cells.empty:
        result.notes.append("no accesses: nothing to correlate")
        return result
    counts, steps = _lift_per_step(cells)
    rng = np.random.default_rng(seed)
    weights = rng.multinomial(len(counts), np.full(len(counts), 1 / len(counts)), size=num_resamples)
    boot = _lift(weights @ counts)
    boot = boot[np.isfinite(boot)]
    total = counts.sum(axis=0)
    n = total[0]
    low, high = np.percentile(boot, [2.5, 97.5]) if boot.size else (np.nan, np.nan)
    rows = [
        AnalysisRow(Analysis.CO_BURST, "p_expert_miss", total[1] / n, "share of cells"),
        AnalysisRow(Analysis.CO_BURST, "p_kv_miss", total[2] / n, "share of cells"),
        AnalysisRow(Analysis.CO_BURST, "p_both", total[3] / n, "share of cells"),
        AnalysisRow(Analysis.CO_BURST, "p_product", total[1] * total[2] / n**2, "share of cells"),
        AnalysisRow(
            Analysis.CO_BURST,
            "lift",
            float(_lift(total)),
            "ratio",
            float(low),
            float(high),
            params={"num_cells": int(n), "num_resamples": num_resamples},
        ),  # fmt: skip
    ]
    all_steps = trace.tables[TraceTable.STEPS].column("step").to_numpy()
    per_step = pd.DataFrame(counts[:, 1:3], index=steps).reindex(np.sort(all_steps), fill_value=0).to_numpy()
    correlations = cross_correlation(per_step[:, 0], per_step[:, 1], max_lag)
    for lag, r, lo, hi in correlations:
        rows.append(AnalysisRow(Analysis.CO_BURST, "cross_correlation", r, "r", lo, hi, params={"lag": lag}))
    finite = [c for c in correlations if np.isfinite(c[1])]
    if finite:
        lag, r, lo, hi = max(finite, key=lambda c: c[1])
        rows.append(AnalysisRow(Analysis.CO_BURST, "peak_lag", float(lag), "steps (KV after experts)",
                                params={"r": r, "ci_low": lo, "ci_high": hi}))  # fmt: skip
    result.rows = rows + contention_rows(trace)
    return result

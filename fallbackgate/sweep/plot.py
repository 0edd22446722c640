"""Sweep heatmaps (matplotlib, Agg): one panel per controller (columns) per metric (rows)."""

from __future__ import annotations

import pathlib
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PLOT_METRICS: tuple[tuple[str, str, float], ...] = (  # (metric, title, divisor)
    ("tpot_mean_ms", "TPOT mean (ms, measured)", 1.0),
    ("expert_exact_bytes", "exact expert bytes (MiB)", 2.0**20),
    ("slo_attainment", "SLO attainment (measured)", 1.0),
    ("mean_kl", "mean KL (nats)", 1.0),
)


def heatmaps(points: list[dict[str, Any]], path: str | pathlib.Path) -> pathlib.Path:
    """Write the expert-fraction × KV-fraction heatmaps of ``points`` to ``path`` (PNG); returns the path."""
    controllers = list(dict.fromkeys(p["controller"] for p in points))
    efs = sorted({p["expert_frac"] for p in points})
    kfs = sorted({p["kv_frac"] for p in points})
    fig, axes = plt.subplots(
        len(PLOT_METRICS), len(controllers), figsize=(3.2 * len(controllers), 2.6 * len(PLOT_METRICS)), squeeze=False
    )
    for row, (metric, title, div) in enumerate(PLOT_METRICS):
        values = [p["metrics"].get(metric, float("nan")) / div for p in points]
        lo, hi = min(values), max(values)
        for col, ctrl in enumerate(controllers):
            grid = [[float("nan")] * len(efs) for _ in kfs]
            for p in points:
                if p["controller"] == ctrl:
                    grid[kfs.index(p["kv_frac"])][efs.index(p["expert_frac"])] = p["metrics"].get(metric, 0.0) / div
            ax = axes[row][col]
            ax.imshow(grid, origin="lower", cmap="viridis", vmin=lo, vmax=hi if hi > lo else lo + 1e-12, aspect="auto")
            for i, kf_row in enumerate(grid):
                for j, v in enumerate(kf_row):
                    bright = hi > lo and (v - lo) / (hi - lo) > 0.6
                    ax.text(j, i, f"{v:.3g}", ha="center", va="center", fontsize=7, color="k" if bright else "w")
            ax.set_xticks(range(len(efs)), [f"{e:g}" for e in efs], fontsize=7)
            ax.set_yticks(range(len(kfs)), [f"{k:g}" for k in kfs], fontsize=7)
            ax.set_title(f"{ctrl}: {title}", fontsize=8)
            ax.set_xlabel("expert budget (frac of all experts)", fontsize=7)
            ax.set_ylabel("KV budget (frac of peak)", fontsize=7)
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path

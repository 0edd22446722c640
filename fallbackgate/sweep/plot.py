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


REGIME_METRICS: tuple[tuple[str, str, float], ...] = (  # (metric, title, divisor)
    ("slo_attainment", "SLO attainment", 1.0),
    ("tpot_p99_ms", "TPOT p99 (ms)", 1.0),
    ("read_bytes", "bytes read (MiB)", 2.0**20),
    ("stall_s", "stall (s)", 1.0),
    ("expert_miss_rate", "expert miss rate", 1.0),
    ("kv_miss_rate", "KV miss rate", 1.0),
)


def _row_label(point: dict[str, Any]) -> str:
    share = point.get("kv_share")
    return point["controller"] if share is None else f"static kv {share:g}"


def regime_heatmaps(points: list[dict[str, Any]], folder: str | pathlib.Path) -> list[pathlib.Path]:
    """One PNG per workload (``sweep-<workload>.png``): per metric, RAM budget (x) × controller / static KV
    share (y), the mean over seeds in each cell; returns the paths."""
    paths = []
    for workload in dict.fromkeys(p["workload"] for p in points):
        mine = [p for p in points if p["workload"] == workload]
        fracs = sorted({p["ram_frac"] for p in mine})
        rows = sorted({_row_label(p) for p in mine}, key=lambda r: (not r.startswith("static"), r))
        of = "another sweep's" if any("ram_basis_bytes" in p for p in mine) else "experts + KV"  # --ram-basis-from
        fig, axes = plt.subplots(1, len(REGIME_METRICS), figsize=(3.0 * len(REGIME_METRICS), 2.8), squeeze=False)
        for ax, (metric, title, div) in zip(axes[0], REGIME_METRICS, strict=True):
            grid = [[float("nan")] * len(fracs) for _ in rows]
            for i, row in enumerate(rows):
                for j, frac in enumerate(fracs):
                    vals = [p["metrics"].get(metric, float("nan")) / div for p in mine
                            if _row_label(p) == row and p["ram_frac"] == frac]  # fmt: skip
                    grid[i][j] = sum(vals) / len(vals) if vals else float("nan")
            ax.imshow(grid, origin="lower", cmap="viridis", aspect="auto")
            for i, line in enumerate(grid):
                for j, v in enumerate(line):
                    ax.text(j, i, f"{v:.3g}", ha="center", va="center", fontsize=7, color="w")
            ax.set_xticks(range(len(fracs)), [f"{f:g}" for f in fracs], fontsize=7)
            ax.set_yticks(range(len(rows)), rows, fontsize=7)
            ax.set_xlabel(f"RAM budget (frac of {of} demand)", fontsize=7)
            ax.set_title(f"{workload}: {title}", fontsize=8)
        fig.tight_layout()
        path = pathlib.Path(folder) / f"sweep-{workload}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths


def anatomy_bars(anatomy: dict[str, Any], path: str | pathlib.Path) -> pathlib.Path:
    """Stacked bars of each cell's P99 request TPOT parts (mean over seeds, ms per token), one bar per run the
    cell compares (its ``runs``, parts in its ``parts`` order, both as :mod:`fallbackgate.sweep.anatomy` writes
    them); writes ``path`` (PNG) and returns it."""
    fig, ax = plt.subplots(figsize=(max(6.0, 1.5 * len(anatomy)), 4.6))
    xs, labels, colours, is_labelled = [], [], {}, False
    for i, (key, cell) in enumerate(anatomy.items()):
        runs = cell.get("runs") or {}
        for j, (name, run_label) in enumerate(runs.items()):
            m, x = cell["mean"].get(name) or {}, i * (len(runs) + 1) + j
            bottom = 0.0
            for part, label in (cell.get("parts") or {}).items():
                colour = colours.setdefault(part, f"C{len(colours)}")
                value = max(0.0, m.get(f"p99_request_{part}", 0.0))
                ax.bar(x, value, bottom=bottom, color=colour, label=None if is_labelled else label, width=0.85)
                bottom += value
            is_labelled = is_labelled or bool(cell.get("parts"))
            xs.append(x)
            labels.append(run_label)
        if runs:
            ax.text(i * (len(runs) + 1) + (len(runs) - 1) / 2, -0.28, key, ha="center", va="top", fontsize=7,
                    transform=ax.get_xaxis_transform())  # fmt: skip
    ax.set_xticks(xs, labels, fontsize=6, rotation=90)
    ax.set_ylabel("P99 request TPOT, ms per token (wall clock)")
    ax.set_title("Where the slowest request's decode time went (mean over seeds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return pathlib.Path(path)

"""PNG figures of the analyses (matplotlib, Agg), one file per analysis and trace."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after the backend is chosen
import numpy as np  # noqa: E402

from fallbackgate.tracing.results import AnalysisResult  # noqa: E402

GIB = float(1 << 30)


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def co_burst_figure(result: AnalysisResult, path: Path, title: str) -> Path:
    """Same-cell probabilities against independence, and the lagged cross-correlation with its interval."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    names = ["p_expert_miss", "p_kv_miss", "p_both", "p_product"]
    left.bar(["expert miss", "KV miss", "both", "product"], [result.value(n) for n in names], color="#4878a8")
    left.set_ylabel("share of (step, layer) cells")
    lift = next(r for r in result.rows if r.metric == "lift")
    left.set_title(f"lift {lift.value:.2f} [{lift.ci_low:.2f}, {lift.ci_high:.2f}]")
    corr = [r for r in result.rows if r.metric == "cross_correlation"]
    lags = np.array([r.params["lag"] for r in corr])
    right.fill_between(lags, [r.ci_low for r in corr], [r.ci_high for r in corr], alpha=0.3, color="#e07b39")
    right.plot(lags, [r.value for r in corr], marker="o", color="#e07b39")
    right.axhline(0, color="gray", lw=0.8)
    right.set_xlabel("lag (steps; KV after experts when positive)")
    right.set_ylabel("cross-correlation of per-step misses")
    fig.suptitle(title)
    return _save(fig, path)


def budget_figure(budgets: np.ndarray, p99_ms: np.ndarray, path: Path, title: str) -> Path:
    """P99 TPOT over the expert × KV budget grid."""
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    labels = [f"{b / GIB:.2f}" for b in budgets]
    image = ax.imshow(p99_ms, origin="lower", cmap="viridis_r")
    ax.set_xticks(range(len(budgets)), labels, rotation=45)
    ax.set_yticks(range(len(budgets)), labels)
    ax.set_xlabel("KV budget (GiB)")
    ax.set_ylabel("expert budget (GiB)")
    fig.colorbar(image, ax=ax, label="P99 TPOT (ms, simulated)")
    ax.set_title(title)
    return _save(fig, path)


def flips_figure(result: AnalysisResult, path: Path, title: str) -> Path:
    """The best static expert share per window, one line per device model."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    devices = sorted({r.device for r in result.rows if r.metric == "best_expert_share"})
    for device in devices:
        rows = [r for r in result.rows if r.metric == "best_expert_share" and r.device == device]
        ax.step([r.params["first_step"] for r in rows], [r.value for r in rows], where="post", label=device)
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("window start (step)")
    ax.set_ylabel("best expert share of the budget")
    ax.legend(fontsize=8)
    ax.set_title(title)
    return _save(fig, path)


def dual_miss_figure(result: AnalysisResult, path: Path, title: str) -> Path:
    """Recompute-versus-load crossover context per phase and device model."""
    rows = [r for r in result.rows if r.metric == "recompute_crossover_tokens"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    labels = [f"{r.device}\n{r.params['phase']}" for r in rows]
    ax.bar(range(len(rows)), [r.value for r in rows], color="#6a9f58")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("context tokens where recompute stops winning")
    ax.set_title(title)
    return _save(fig, path)


def prediction_figure(result: AnalysisResult, path: Path, title: str) -> Path:
    """Wrongly fetched and covered miss bytes per predictor."""
    predictors = ["router", "kv_recency", "joint"]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    x = np.arange(len(predictors))
    for offset, metric, label in ((-0.2, "wrongly_fetched_bytes", "wrongly fetched (est.)"),
                                  (0.2, "covered_miss_bytes", "covered misses")):  # fmt: skip
        ax.bar(x + offset, [result.value(metric, predictor=p) / GIB for p in predictors], 0.4, label=label)
    ax.set_xticks(x, predictors)
    ax.set_ylabel("GiB")
    ax.legend(fontsize=8)
    ax.set_title(title)
    return _save(fig, path)

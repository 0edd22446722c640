"""Who should get the next GiB, whether the best static split flips over time, and whether devices flip it.

Every number here comes from pricing the trace's own access sequence under LRU caches of each kind
(:mod:`fallbackgate.tracing.cachesim`) on a device model (:mod:`fallbackgate.tracing.devices`).
"""

from __future__ import annotations

import numpy as np

from fallbackgate.tracing.devices import DeviceModel
from fallbackgate.tracing.results import Analysis, AnalysisResult, AnalysisRow
from fallbackgate.tracing.timeline import Timeline

GIB = float(1 << 30)
OUTCOMES = (("stall_s", "s"), ("slo_violations", "requests"), ("p99_tpot_ms", "ms"))


def base_budgets(timeline: Timeline) -> tuple[float, float]:
    """The recorded (expert, KV) budgets; where the trace has none, half of each kind's distinct bytes."""
    if timeline.total_budget_bytes > 0:
        return timeline.base_budget_bytes
    halves = []
    for stream in (timeline.experts, timeline.kv):
        halves.append(0.5 * np.sum(stream.distances < 0) * stream.bytes_per_object)
    return halves[0], halves[1]


def marginal_value(timeline: Timeline, devices: list[DeviceModel], delta_bytes: float | None = None) -> AnalysisResult:
    """Stall, SLO violations and P99 TPOT removed per extra GiB given to experts versus to KV, per device."""
    expert_base, kv_base = base_budgets(timeline)
    delta = float(delta_bytes or (expert_base + kv_base) / 4)
    result = AnalysisResult(Analysis.MARGINAL_VALUE)
    params = {"expert_gib": expert_base / GIB, "kv_gib": kv_base / GIB, "delta_gib": delta / GIB}
    for device in devices:
        base = timeline.outcome(timeline.step_ns(expert_base, kv_base, device))
        more = {
            "experts": timeline.outcome(timeline.step_ns(expert_base + delta, kv_base, device)),
            "kv": timeline.outcome(timeline.step_ns(expert_base, kv_base + delta, device)),
        }
        for metric, unit in OUTCOMES:
            result.rows.append(AnalysisRow(Analysis.MARGINAL_VALUE, f"{metric}_at_base", base[metric], unit,
                                           device=device.name, params=params))  # fmt: skip
            for kind, outcome in more.items():
                gain = (base[metric] - outcome[metric]) / (delta / GIB)
                result.rows.append(AnalysisRow(Analysis.MARGINAL_VALUE, f"{metric}_reduced_per_gib_{kind}", gain,
                                               f"{unit}/GiB", device=device.name, params=params))  # fmt: skip
        gains = {k: base["stall_s"] - o["stall_s"] for k, o in more.items()}
        winner = max(gains, key=lambda k: gains[k]) if max(gains.values()) > 0 else "neither"
        result.rows.append(AnalysisRow(Analysis.MARGINAL_VALUE, "next_gib_to_experts", float(winner == "experts"),
                                       device=device.name, params={**params, "winner": winner}))  # fmt: skip
    return result


def budget_grid(timeline: Timeline, device: DeviceModel, num_points: int = 9) -> tuple[np.ndarray, np.ndarray]:
    """(budgets in bytes, [expert, kv] P99 TPOT in ms) over 0..2x the base total per kind."""
    expert_base, kv_base = base_budgets(timeline)
    budgets = np.linspace(0, expert_base + kv_base, num_points)
    grid = np.array([[timeline.outcome(timeline.step_ns(e, k, device))["p99_tpot_ms"] for k in budgets]
                     for e in budgets])  # fmt: skip
    return budgets, grid


def _best_per_window(costs: np.ndarray) -> np.ndarray:
    """Argmin per window over shares; ties go to the previous window's choice, else the middle tied share."""
    best = []
    for window_costs in costs.T:
        tied = np.flatnonzero(np.isclose(window_costs, window_costs.min(), rtol=1e-9, atol=1.0))
        best.append(best[-1] if best and best[-1] in tied else int(tied[len(tied) // 2]))
    return np.array(best)


def split_costs(timeline: Timeline, device: DeviceModel, shares: np.ndarray, window_steps: int) -> np.ndarray:
    """[share, window] total step time (ns) with the total budget split ``share`` to experts."""
    total = sum(base_budgets(timeline))
    window_of_step = np.arange(timeline.num_steps) // window_steps
    num_windows = int(window_of_step[-1]) + 1 if timeline.num_steps else 0
    rows = []
    for share in shares:
        step_ns = timeline.step_ns(share * total, (1 - share) * total, device)
        rows.append(np.bincount(window_of_step, weights=step_ns, minlength=num_windows))
    return np.array(rows)


def flips(
    timeline: Timeline, devices: list[DeviceModel], num_windows: int = 10, num_shares: int = 17
) -> AnalysisResult:
    """The best static expert share of the total budget per time window, how often it changes, per device;
    and (analysis "devices") whether the devices disagree on the whole-trace best share."""
    shares = np.linspace(0, 1, num_shares)
    window_steps = max(1, -(-timeline.num_steps // num_windows))
    result = AnalysisResult(Analysis.FLIPS)
    whole_best = {}
    for device in devices:
        costs = split_costs(timeline, device, shares, window_steps)
        best = _best_per_window(costs)
        for window, index in enumerate(best):
            params = {"window": window, "first_step": int(timeline.step_ids[window * window_steps])}
            result.rows.append(AnalysisRow(Analysis.FLIPS, "best_expert_share", float(shares[index]), "share",
                                           device=device.name, params=params))  # fmt: skip
        num_flips = int(np.sum(best[1:] != best[:-1]))
        result.rows.append(AnalysisRow(Analysis.FLIPS, "num_flips", float(num_flips), "changes", device=device.name,
                                       params={"num_windows": len(best), "window_steps": window_steps}))  # fmt: skip
        whole = costs.sum(axis=1)
        whole_best[device.name] = float(shares[_best_per_window(whole[:, None])[0]])
        penalty = float(whole.min() / max(costs.min(axis=0).sum(), 1.0) - 1)  # static best vs per-window best
        result.rows.append(AnalysisRow(Analysis.FLIPS, "static_over_per_window_time", penalty, "ratio - 1",
                                       device=device.name))  # fmt: skip
        result.rows.append(AnalysisRow(Analysis.DEVICES, "best_expert_share_whole_trace", whole_best[device.name],
                                       "share", device=device.name))  # fmt: skip
    distinct = len(set(whole_best.values()))
    result.rows.append(AnalysisRow(Analysis.DEVICES, "devices_disagreeing_on_best_share", float(distinct - 1),
                                   "devices", params={"best": whole_best}))  # fmt: skip
    return result

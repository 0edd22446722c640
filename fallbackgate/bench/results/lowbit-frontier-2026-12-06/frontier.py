"""python fallbackgate/bench/results/lowbit-frontier-2026-12-06/frontier.py NAME=SWEEP_JSON[,...] ... [--json F]

Joint's expert bytes over Belady's MIN at the same room against the audited quality it cost, one line per
variant of admission and class budgets (its parts over different seeds comma-separated; the first variant is
the reference): the pooled mean and Student-t 95 % interval of the per-run ratio, the same ratio against the
*reference* run's MIN (the exact-only trace: low-bit experts change later routing a little), the share of runs
at most 1.3×, mean and worst mean KL, worst per-run P99 KL, lowest top-1 agreement, gates passed, low-bit uses,
SLO attainment and P99 TPOT, and per cell the mean ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

from fallbackgate.sweep.intervals import interval
from fallbackgate.sweep.summary import expert_read_bytes

GOAL = 1.3


def _runs(paths: str) -> dict[tuple[str, float, int], dict]:
    """Joint's runs of the comma-separated sweep.jsons (parts of one variant over different seeds)."""
    points = [p for path in paths.split(",") for p in json.load(open(path))["points"]]
    return {(p["workload"], p["ram_frac"], p["seed"]): p["metrics"] for p in points if p["controller"] == "joint"}


def summarise(runs: dict, reference: dict) -> dict:
    """The variant's numbers (see the module docstring)."""
    own = {k: expert_read_bytes(m) / m["belady_expert_bytes_same_room"] for k, m in runs.items()}
    ref = {k: expert_read_bytes(m) / reference[k]["belady_expert_bytes_same_room"] for k, m in runs.items()}
    cells: dict[str, list[float]] = defaultdict(list)
    for (workload, ram, _), ratio in own.items():
        cells[f"{workload}@{ram}"].append(ratio)
    ms = list(runs.values())
    return {
        "num_runs": len(ms),
        "over_min_same_room": interval(list(own.values())),
        "over_reference_min": interval(list(ref.values())),
        "share_runs_at_most_goal": sum(r <= GOAL for r in own.values()) / len(own),
        "mean_kl": statistics.fmean(m["mean_kl"] for m in ms),
        "worst_mean_kl": max(m["mean_kl"] for m in ms),
        "worst_p99_kl": max(m["max_p99_kl"] for m in ms),
        "min_top1_agreement": min(m["top1_agreement"] for m in ms),
        "gates_passed": sum(bool(m["gate_passed"]) for m in ms),
        "lowbit_uses_per_run": statistics.fmean(m.get("count_expert_expert_lowbit", 0.0) for m in ms),
        "slo_attainment": statistics.fmean(m["slo_attainment"] for m in ms),
        "tpot_p99_ms": statistics.fmean(m["tpot_p99_ms"] for m in ms),
        "cells": {c: statistics.fmean(v) for c, v in sorted(cells.items())},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweeps", nargs="+", metavar="NAME=SWEEP_JSON")
    parser.add_argument("--json", default=None)
    parser.add_argument("--common", action="store_true", help="only the runs (cell and seed) every variant has")
    args = parser.parse_args()
    runs = {name: _runs(path) for name, path in dict(s.split("=", 1) for s in args.sweeps).items()}
    if args.common:
        keys = set.intersection(*(set(r) for r in runs.values()))
        runs = {name: {k: m for k, m in r.items() if k in keys} for name, r in runs.items()}
    reference = next(iter(runs.values()))
    out = {name: summarise(r, reference) for name, r in runs.items()}
    for name, s in out.items():
        iv, rf = s["over_min_same_room"], s["over_reference_min"]
        print(
            f"{name:16s} {iv['mean']:.3f}x [{iv['lo']:.3f}, {iv['hi']:.3f}] (vs reference MIN {rf['mean']:.3f}x) "
            f"runs<=1.3x {s['share_runs_at_most_goal']:.0%}  KL mean {s['mean_kl']:.1e} "
            f"worst {s['worst_mean_kl']:.1e} p99 {s['worst_p99_kl']:.1e} top1 >= {s['min_top1_agreement']:.4f} "
            f"gates {s['gates_passed']}/{s['num_runs']} low-bit/run {s['lowbit_uses_per_run']:.1f} "
            f"SLO {s['slo_attainment']:.3f} P99 TPOT {s['tpot_p99_ms']:.1f} ms"
        )
        print("    " + "  ".join(f"{c} {v:.3f}" for c, v in s["cells"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

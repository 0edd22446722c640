"""python -m fallbackgate.bench.joint_ab A.json B.json [--metrics M,M,...]

Joint in sweep B against joint in sweep A (an A/B of a controller or engine change; ``--controller
independent_lru`` pairs the two LRUs' runs instead), paired by (workload, RAM budget, seed):
per cell and metric A's and B's means, and the mean paired difference as % of A's mean with its Student-t 95 %
interval over the seeds (:func:`fallbackgate.sweep.intervals.interval`). A metric is a run's measure in the
sweep.json (missing: 0) or one of :data:`DERIVED`.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Callable
from typing import Any

from fallbackgate.sweep.intervals import interval
from fallbackgate.sweep.summary import INDEPENDENT, JOINT, expert_read_bytes


def over_belady_same_room(m: dict[str, Any]) -> float:
    """Expert bytes read over Belady's MIN at the same room; nan where the run has no bound (a sweep recorded
    before it, or a run with nothing to read)."""
    bound = m.get("belady_expert_bytes_same_room")
    return expert_read_bytes(m) / bound if bound else math.nan


DERIVED: dict[str, Callable[[dict[str, Any]], float]] = {
    "expert_read": expert_read_bytes,  # exact plus low-bit expert bytes read
    "over_belady_same_room": over_belady_same_room,
    "lowbit_uses": lambda m: m.get("count_expert_expert_lowbit", 0.0),
}
DEFAULT_METRICS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p99_ms", "slo_attainment", "read_bytes", "stall_s")


def joint_points(path: str, controller: str = JOINT) -> dict[tuple[str, float, int], dict[str, Any]]:
    """The `controller` runs' metrics of a sweep.json by (workload, RAM budget, seed) (joint's by default;
    static_split's runs differ by KV share, so they are not one run per key)."""
    with open(path) as f:
        points = json.load(f)["points"]
    return {(p["workload"], p["ram_frac"], p["seed"]): p["metrics"] for p in points if p["controller"] == controller}


def value(m: dict[str, Any], metric: str) -> float:
    """One run's `metric`: a derived one, else the recorded measure (0 where the run recorded none)."""
    return DERIVED[metric](m) if metric in DERIVED else float(m.get(metric) or 0.0)


def compare_lines(a: dict, b: dict, metrics: tuple[str, ...]) -> list[str]:
    """Per cell present in both, one line per metric: means and the paired difference in % of A's mean."""
    lines = []
    for cell in sorted({key[:2] for key in a if key in b}):
        seeds = sorted(key[2] for key in a if key[:2] == cell and key in b)
        lines.append(f"{cell[0]}@{cell[1]} n={len(seeds)}")
        for metric in metrics:
            xs, ys = ([value(runs[(*cell, s)], metric) for s in seeds] for runs in (a, b))
            mean_a = statistics.fmean(xs)
            iv = interval([y - x for x, y in zip(xs, ys, strict=True)])
            pct = [100 * iv[k] / mean_a for k in ("mean", "lo", "hi")] if mean_a else []
            change = f"{pct[0]:+.1f}% [{pct[1]:+.1f}, {pct[2]:+.1f}]" if pct else "n/a: A's mean is 0"
            lines.append(f"  {metric:24s} {mean_a:.4g} -> {statistics.fmean(ys):.4g} ({change})")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m fallbackgate.bench.joint_ab", description=__doc__.splitlines()[2])
    p.add_argument("a", help="sweep.json of the shipped controller")
    p.add_argument("b", help="sweep.json of the changed controller")
    p.add_argument("--metrics", default=",".join(DEFAULT_METRICS), help="comma-separated measures (see DERIVED)")
    p.add_argument("--controller", default=JOINT, choices=(JOINT, INDEPENDENT),
                   help="whose runs to pair (independent_lru: a control, the same baseline run twice)")  # fmt: skip
    args = p.parse_args(argv)
    a, b = (joint_points(path, args.controller) for path in (args.a, args.b))
    print("\n".join(compare_lines(a, b, tuple(args.metrics.split(",")))))


if __name__ == "__main__":
    main()

"""python fallbackgate/bench/results/lowbit-admission-2026-12-05/compare.py A.json B.json

Joint in sweep B against joint in sweep A, paired by (workload, RAM budget, seed): each metric's means and the
mean paired difference as % of A's mean, with a Student-t 95 % interval over the seeds; expert bytes (exact plus
low-bit) also over Belady's MIN at the same room, and low-bit uses per run.
"""

import collections
import json
import statistics
import sys

from scipy import stats

METRICS = ("ttft_p50_ms", "tpot_p99_ms", "slo_attainment", "stall_s", "mean_kl", "expert_read",
           "over_belady_same_room", "lowbit_uses")  # fmt: skip


def joint_points(path: str) -> dict[tuple, dict]:
    """The joint runs' metrics of a sweep.json by (workload, RAM budget, seed)."""
    points = json.load(open(path))["points"]
    return {(p["workload"], p["ram_frac"], p["seed"]): p["metrics"] for p in points if p["controller"] == "joint"}


def expert_read(m: dict) -> float:
    return sum(v for k, v in m.items() if k.startswith("bytes_expert_") and not k.endswith("_resident"))


def value(m: dict, metric: str) -> float:
    if metric == "expert_read":
        return expert_read(m)
    if metric == "over_belady_same_room":
        return expert_read(m) / m["belady_expert_bytes_same_room"]
    if metric == "lowbit_uses":
        return m.get("count_expert_expert_lowbit", 0.0)
    return m[metric]


def main() -> None:
    a, b = joint_points(sys.argv[1]), joint_points(sys.argv[2])
    cells = collections.defaultdict(list)
    for key in sorted(k for k in a if k in b):
        cells[key[:2]].append(key)
    for (workload, ram), keys in sorted(cells.items()):
        print(f"{workload}@{ram} n={len(keys)}")
        for metric in METRICS:
            xs, ys = [value(a[k], metric) for k in keys], [value(b[k], metric) for k in keys]
            diffs = [y - x for x, y in zip(xs, ys, strict=True)]
            mean_a, mean_d = statistics.fmean(xs), statistics.fmean(diffs)
            half = stats.t.ppf(0.975, len(diffs) - 1) * statistics.stdev(diffs) / len(diffs) ** 0.5
            shown = [f"{100 * x / mean_a:+.1f}" if mean_a else "n/a" for x in (mean_d, mean_d - half, mean_d + half)]
            print(f"  {metric:24s} {mean_a:.4g} -> {statistics.fmean(ys):.4g} "
                  f"({shown[0]}% [{shown[1]}, {shown[2]}])")  # fmt: skip


if __name__ == "__main__":
    main()

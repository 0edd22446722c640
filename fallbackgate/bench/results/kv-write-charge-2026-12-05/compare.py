"""python fallbackgate/bench/results/kv-write-charge-2026-12-05/compare.py A.json B.json

Joint in sweep B against joint in sweep A, paired by (workload, RAM budget, seed): each metric's means and the
mean paired difference as % of A's mean, with a Student-t 95 % interval over the seeds.
"""

from __future__ import annotations

import json
import statistics
import sys

from scipy import stats

METRICS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p99_ms", "slo_attainment", "read_bytes", "stall_s",
           "io_kv_block_write_disk_bytes")  # fmt: skip


def joint_points(path: str) -> dict[tuple[str, float, int], dict[str, float]]:
    """The joint runs' metrics of a sweep.json by (workload, RAM budget, seed)."""
    points = json.loads(open(path).read())["points"]
    return {(p["workload"], p["ram_frac"], p["seed"]): p["metrics"] for p in points if p["controller"] == "joint"}


def main(argv: list[str]) -> None:
    a, b = joint_points(argv[0]), joint_points(argv[1])
    for cell in sorted({key[:2] for key in a}):
        seeds = sorted(key[2] for key in a if key[:2] == cell and key in b)
        print(f"{cell[0]}@{cell[1]} n={len(seeds)}")
        for metric in METRICS:
            before = [a[(*cell, s)].get(metric) or 0.0 for s in seeds]
            after = [b[(*cell, s)].get(metric) or 0.0 for s in seeds]
            diff = [y - x for x, y in zip(before, after, strict=True)]
            half = stats.t.ppf(0.975, len(diff) - 1) * statistics.stdev(diff) / len(diff) ** 0.5
            scale = statistics.fmean(before) or 1.0
            mean = statistics.fmean(diff)
            means = f"{statistics.fmean(before):.4g}->{statistics.fmean(after):.4g}"
            print(f"  {metric} {means} ({100 * mean / scale:+.1f}% "
                  f"[{100 * (mean - half) / scale:+.1f}, {100 * (mean + half) / scale:+.1f}])")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])

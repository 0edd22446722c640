"""python did.py SHIPPED_PART.json JOINT_RERUN.json LRU_RERUN.json [--metrics M,...]

    python did.py ../../../sweep_results/seeds0-9/sweep.json joint-rerun-seeds0-9.json lru-rerun-seeds0-9.json

Write-behind's effect on joint, the machine's drift taken out (stop 46): the shipped part (every controller,
spills written at once) was rerun hours later, joint with write-behind and the two LRUs (whose runs write no KV
at a step's end, so the engine change cannot touch them) as a control, both against the shipped part's SLO
targets (``fallbackgate sweep --slo-from``). Per cell and metric: the mean over seeds of joint's change and the
LRUs' change (rerun ÷ shipped − 1, in %, Student-t 95 % interval), and of their difference per seed — joint's
change beyond the drift both saw. For SLO attainment (which can be 0) changes are in attainment points.
"""

from __future__ import annotations

import argparse

from fallbackgate.bench.joint_ab import joint_points as runs
from fallbackgate.sweep.intervals import interval

POINTS_METRICS = ("slo_attainment",)  # changes in attainment points, not ratios


def change(new: float, old: float, metric: str) -> float:
    if metric in POINTS_METRICS:
        return 100.0 * (new - old)
    return 100.0 * (new / old - 1.0) if old > 0 else float("nan")


def fmt(i: dict) -> str:
    return f"{i['mean']:+.1f} [{i['lo']:+.1f}, {i['hi']:+.1f}]"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("shipped")
    p.add_argument("joint_rerun")
    p.add_argument("lru_rerun")
    p.add_argument("--metrics", default="ttft_p50_ms,tpot_p99_ms,slo_attainment,stall_s")
    args = p.parse_args()
    j0, l0 = runs(args.shipped, "joint"), runs(args.shipped, "independent_lru")
    j1, l1 = runs(args.joint_rerun, "joint"), runs(args.lru_rerun, "independent_lru")
    cells = sorted({(w, r) for w, r, _ in j1})
    print("cell | metric | joint's change | the LRUs' change (drift) | joint's beyond the drift")
    for w, r in cells:
        keys = sorted(k for k in j1 if k[:2] == (w, r) and k in l1)
        for metric in args.metrics.split(","):
            dj = [change(j1[k][metric], j0[k][metric], metric) for k in keys]
            dl = [change(l1[k][metric], l0[k][metric], metric) for k in keys]
            beyond = [a - b for a, b in zip(dj, dl, strict=True)]
            print(f"{w}@{r} | {metric} | {fmt(interval(dj))} | {fmt(interval(dl))} | {fmt(interval(beyond))}")


if __name__ == "__main__":
    main()

"""python fallbackgate/sweep_results/seeds140-149/order.py fallbackgate/sweep_results/seeds140-149/sweep.json
   (and on the pools of the rotated parts: ... fallbackgate/sweep_results/rotated20/sweep.json, rotated30/sweep.json)

The first sweep part with the controllers' order rotated by the seed (stop 53): seed mod 3 puts joint first
(seeds 140, 143, 146, 149), in the middle (142, 145, 148) or last (141, 144, 147) of the seed's cells. Joint's
gain per (workload, RAM) cell — P99 TPOT 1 - joint/partner, SLO attainment joint - partner (points) — against
two LRUs and against each static split (KV share 0.1, 0.3, 0.5), averaged over the 10 cells of each seed, then
over the seeds of each position (Student-t 95 %). An order effect that favoured whoever ran last would show as
joint's gain growing from first to last; ``last - first`` (Welch 95 %) is that growth.
"""

import json
import statistics
import sys

from scipy import stats

CONTROLLERS = ["static_split", "independent_lru", "joint"]


def position(seed: int) -> str:
    order = CONTROLLERS[seed % 3 :] + CONTROLLERS[: seed % 3]
    return ["first", "middle", "last"][order.index("joint")]


def interval(xs: list[float]) -> str:
    m = statistics.mean(xs)
    if len(xs) < 2:
        return f"{m:+.1f} (n=1)"
    h = stats.t.ppf(0.975, len(xs) - 1) * statistics.stdev(xs) / len(xs) ** 0.5
    return f"{m:+.1f} [{m - h:+.1f}, {m + h:+.1f}] (n={len(xs)})"


def main(path: str) -> None:
    result = json.loads(open(path).read())
    cells: dict[tuple, dict[str, dict]] = {}
    for p in result["points"]:
        name = p["controller"] if p["controller"] != "static_split" else f"static_{p['kv_share']}"
        cells.setdefault((p["workload"], p["ram_frac"], p["seed"]), {})[name] = p["metrics"]
    for partner in ("independent_lru", "static_0.1", "static_0.3", "static_0.5"):
        by_seed: dict[int, list[tuple[float, float]]] = {}
        for (_, _, seed), ms in cells.items():
            j, o = ms["joint"], ms[partner]
            p99 = 100 * (1 - j["tpot_p99_ms"] / o["tpot_p99_ms"])
            slo = 100 * (j["slo_attainment"] - o["slo_attainment"])
            by_seed.setdefault(seed, []).append((p99, slo))
        for pos in ("first", "middle", "last"):
            seeds = sorted(s for s in by_seed if position(s) == pos)
            p99 = [statistics.mean(x for x, _ in by_seed[s]) for s in seeds]
            slo = [statistics.mean(y for _, y in by_seed[s]) for s in seeds]
            print(f"vs {partner:16} joint {pos:6} seeds {seeds}: P99 TPOT gain % {interval(p99)}; "
                  f"SLO attainment points {interval(slo)}")
        first, last = ([s for s in by_seed if position(s) == pos] for pos in ("first", "last"))
        diffs = [welch([statistics.mean(v[k] for v in by_seed[s]) for s in last],
                       [statistics.mean(v[k] for v in by_seed[s]) for s in first]) for k in (0, 1)]
        print(f"vs {partner:16} last - first: P99 TPOT {diffs[0]}; SLO attainment {diffs[1]}")


def welch(a: list[float], b: list[float]) -> str:
    """mean(a) - mean(b) with a Welch 95 % interval (n/a below two seeds a side)."""
    d = statistics.mean(a) - statistics.mean(b)
    if min(len(a), len(b)) < 2:
        return f"{d:+.1f} (n/a)"
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    dof = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    h = stats.t.ppf(0.975, dof) * (va + vb) ** 0.5
    return f"{d:+.1f} [{d - h:+.1f}, {d + h:+.1f}]"


if __name__ == "__main__":
    main(sys.argv[1])

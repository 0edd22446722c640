"""python fallbackgate/bench/results/order-effect-2026-12-06/order.py --seeds 100,...,115 --out order.json
   python fallbackgate/bench/results/order-effect-2026-12-06/order.py --summarize order.json

Does the sweep's fixed order (each seed: the static splits, then two LRUs, then joint) favour one controller?
Per seed, mixed@0.25 runs every cell twice, once in the sweep's order and once reversed (joint first), the two
passes alternating which comes first by seed; against seeds 50-59's SLO targets. Prints, per order, joint's
paired gain over each partner (SLO attainment, P99 TPOT) and the difference between the orders (Student-t 95 %
over the seeds), then each controller's own metrics in the reversed pass against the sweep-order pass. JSON out,
rewritten after each seed; ``--summarize`` prints the two summaries of a finished JSON again."""

import argparse
import dataclasses
import json
import pathlib
import tempfile

from fallbackgate.ledger.db import open_ledger
from fallbackgate.sweep.inputs import earlier_references
from fallbackgate.sweep.intervals import interval, percent_interval
from fallbackgate.sweep.regime import INDEPENDENT, JOINT, STATIC, RegimeConfig, run_regime
from fallbackgate.sweep.summary import gain
from fallbackgate.tinymoe import CHECKPOINT_DIR

SLO_FROM = pathlib.Path("fallbackgate/sweep_results/seeds50-59/sweep.json")
ORDERS = {"sweep": (STATIC, INDEPENDENT, JOINT), "reversed": (JOINT, INDEPENDENT, STATIC)}
METRICS = ("slo_attainment", "tpot_p99_ms")


def label(point: dict) -> str:
    return point["controller"] + ("" if point["kv_share"] is None else f" KV {point['kv_share']:g}")


def as_run(order: tuple[str, ...], seed: int) -> tuple[str, ...]:
    """The controllers to configure so that the sweep, which rotates them by the seed since b67f409
    (``regime.grid``), runs them in `order` (counter-rotated; the committed results ran at 0e52c6d, before the
    rotation, where this is `order` itself for every seed)."""
    shift = seed % len(order)
    return order[len(order) - shift:] + order[:len(order) - shift]


def gains(points: list[dict]) -> dict[str, dict[str, float]]:
    """Joint's gain over each partner as the sweep's summary computes it (positive: joint better)."""
    by = {label(p): p["metrics"] for p in points}
    return {name: {k: gain(k, by["joint"][k], m[k]) for k in METRICS} for name, m in by.items() if name != "joint"}


def positions(rows: list[dict]) -> None:
    """Each controller's metrics, reversed pass / sweep-order pass − 1, paired per seed."""
    by: dict[str, dict[str, dict[int, tuple[int, dict]]]] = {}
    for r in rows:
        for i, point in enumerate(r["points"]):
            by.setdefault(label(point), {}).setdefault(r["order"], {})[r["seed"]] = (i, point["metrics"])
    for name, o in by.items():
        seeds = sorted(set(o["sweep"]) & set(o["reversed"]))
        moved = f"position {o['sweep'][seeds[0]][0]} -> {o['reversed'][seeds[0]][0]}"
        for m in ("tpot_p99_ms", "ttft_p50_ms", "slo_attainment", "stall_s", "read_bytes"):
            d = [o["reversed"][s][1][m] / o["sweep"][s][1][m] - 1 if o["sweep"][s][1][m] else 0.0 for s in seeds]
            print(f"{name:20s} {moved} {m:15s} {percent_interval(interval(d), 1)} (n={len(d)})")


def summarize(rows: list[dict]) -> None:
    partners = sorted(rows[0]["gains"])
    for partner in partners:
        for metric in METRICS:
            per = {o: {r["seed"]: r["gains"][partner][metric] for r in rows if r["order"] == o} for o in ORDERS}
            both = sorted(set(per["sweep"]) & set(per["reversed"]))
            diff = interval([per["reversed"][s] - per["sweep"][s] for s in both])
            print(f"{partner:18s} {metric:15s} sweep order {percent_interval(interval(list(per['sweep'].values())), 1)}"
                  f"  reversed {percent_interval(interval(list(per['reversed'].values())), 1)}"
                  f"  reversed - sweep {percent_interval(diff, 1)} (n={len(both)})")
    positions(rows)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds")
    p.add_argument("--out", type=pathlib.Path)
    p.add_argument("--summarize", type=pathlib.Path)
    args = p.parse_args()
    if args.summarize:
        summarize(json.loads(args.summarize.read_text())["rows"])
        return
    seeds = [int(s) for s in args.seeds.split(",")]
    fracs = tuple(json.loads(SLO_FROM.read_text())["config"]["ram_fracs"])
    rows = []
    with tempfile.TemporaryDirectory(prefix="fg-order-") as scratch:
        ledger = open_ledger(f"sqlite:///{scratch}/ledger.sqlite")
        base = RegimeConfig(model_dir=str(CHECKPOINT_DIR), workloads=("mixed",), seeds=(seeds[0],))
        base = dataclasses.replace(base, lowbit_dir=f"{scratch}/lowbit",
                                   slo_from=earlier_references(base, SLO_FROM))
        base = dataclasses.replace(base, ram_fracs=(0.25,))
        assert 0.25 in fracs
        for i, seed in enumerate(seeds):
            names = list(ORDERS) if i % 2 == 0 else list(reversed(ORDERS))
            for name in names:
                cfg = dataclasses.replace(base, seeds=(seed,), controllers=as_run(ORDERS[name], seed))
                points = run_regime(cfg, ledger, log=lambda line: None)["points"]
                rows.append({"seed": seed, "order": name, "first": names[0], "points": points, "gains": gains(points)})
                print(seed, name, {k: {m: round(v, 3) for m, v in g.items()} for k, g in rows[-1]["gains"].items()},
                      flush=True)
            args.out.write_text(json.dumps({"rows": rows}, indent=1, default=str))
        ledger.close()
    summarize(rows)


if __name__ == "__main__":
    main()

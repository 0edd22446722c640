"""python fallbackgate/bench/results/lowbit-fastpath-2026-12-06/window_ab.py SEEDS WORKLOADS RAM OUT.json

The two versions of the fast low-bit path, run after run per seed and workload (order rotated by seed), beside
joint as shipped: `lowbit_colder` (opened budget) with the settings of 8c825b7 (a read-ahead window of two,
dequantization chunks a quarter of a matrix within 64 KiB-1 MiB of fp32) and with those of 386f9b6 (every
persisted copy of a layer read ahead at once, 1 MiB chunks). Prints the paired change of each against the shipped
joint, and of the 8c825b7 settings against the 386f9b6 ones (Student-t 95 % over seeds)."""

import contextlib
import json
import sys
import tempfile

import yaml

from fallbackgate.engine.experts import lowbit_copies
from fallbackgate.engine.experts.lowbit_ahead import LowbitReadAhead
from fallbackgate.ledger.db import open_ledger
from fallbackgate.sweep.intervals import interval
from fallbackgate.sweep.regime import RegimeConfig, run_regime
from fallbackgate.sweep.summary import expert_read_bytes
from fallbackgate.tinymoe import CHECKPOINT_DIR

OPEN = yaml.safe_load(open("fallbackgate/bench/results/lowbit-frontier-2026-12-06/best-effort-open.yaml"))
VARIANTS = {"shipped": ("exact", None, False), "window2": ("lowbit_colder", OPEN, False),
            "all_ahead": ("lowbit_colder", OPEN, True)}  # fmt: skip
METRICS = ("ttft_p50_ms", "tpot_p99_ms", "slo_attainment", "over_min", "lowbit_uses", "mean_kl")


@contextlib.contextmanager
def first_version(is_first: bool):
    """386f9b6's settings while the block runs, when `is_first`."""
    saved = (LowbitReadAhead.__init__.__defaults__, lowbit_copies.DEQUANT_NUMEL)
    if is_first:
        LowbitReadAhead.__init__.__defaults__ = (1 << 16,)
        lowbit_copies.DEQUANT_NUMEL = (1 << 18, 1 << 18)
    try:
        yield
    finally:
        LowbitReadAhead.__init__.__defaults__, lowbit_copies.DEQUANT_NUMEL = saved


def run(seed: int, workload: str, ram: float, name: str, scratch: str, refs: dict) -> dict:
    admission, budgets, is_first = VARIANTS[name]
    cfg = RegimeConfig(model_dir=str(CHECKPOINT_DIR), workloads=(workload,), seeds=(seed,), ram_fracs=(ram,),
                       controllers=("joint",), expert_admission=admission, class_budgets=budgets,
                       slo_from={workload: refs[workload]}, lowbit_dir=f"{scratch}/lowbit")  # fmt: skip
    with first_version(is_first):
        (point,) = run_regime(cfg, open_ledger(f"sqlite:///{scratch}/ledger.sqlite"), log=lambda line: None)["points"]
    m = point["metrics"]
    return {"seed": seed, "workload": workload, "ram_frac": ram, "variant": name,
            "over_min": expert_read_bytes(m) / m["belady_expert_bytes_same_room"],
            "lowbit_uses": m.get("count_expert_expert_lowbit", 0.0), "gate_passed": m["gate_passed"],
            **{k: m[k] for k in ("ttft_p50_ms", "tpot_p99_ms", "slo_attainment", "mean_kl", "load_avg_1m")},
            }  # fmt: skip


def _change(by: dict, seeds: list[int], metric: str, name: str, base_name: str) -> str:
    base = [by[s][base_name][metric] for s in seeds]
    other = [by[s][name][metric] for s in seeds]
    mean_base = sum(base) / len(base)
    iv = interval([(o - b) / mean_base for o, b in zip(other, base, strict=True)]) if mean_base else None
    change = f" ({100 * iv['mean']:+.1f} % [{100 * iv['lo']:+.1f}, {100 * iv['hi']:+.1f}])" if iv else ""
    return f"{sum(other) / len(other):.3g}{change}"


def report(rows: list[dict]) -> None:
    for workload in dict.fromkeys(r["workload"] for r in rows):
        by = {}
        for r in rows:
            if r["workload"] == workload:
                by.setdefault(r["seed"], {})[r["variant"]] = r
        seeds = sorted(by)
        print(f"{workload}@{rows[0]['ram_frac']} n={len(seeds)}")
        for metric in METRICS:
            mean_base = sum(by[s]["shipped"][metric] for s in seeds) / len(seeds)
            parts = [f"shipped {mean_base:.3g}"]
            parts += [f"{name} {_change(by, seeds, metric, name, 'shipped')}" for name in list(VARIANTS)[1:]]
            parts.append(f"| window2 vs all_ahead {_change(by, seeds, metric, 'window2', 'all_ahead')}")
            print(f"  {metric:14s} " + "  ".join(parts))


def main() -> None:
    seeds, workloads, ram = [int(s) for s in sys.argv[1].split(",")], sys.argv[2].split(","), float(sys.argv[3])
    refs = json.load(open("fallbackgate/sweep_results/seeds50-59/sweep.json"))["slo_references"]
    names, rows = list(VARIANTS), []
    with tempfile.TemporaryDirectory() as scratch:
        for i, seed in enumerate(seeds):
            for workload in workloads:
                for name in names[i % 3 :] + names[: i % 3]:
                    rows.append(run(seed, workload, ram, name, scratch, refs))
                    print(json.dumps(rows[-1]), flush=True)
    json.dump(rows, open(sys.argv[4], "w"), indent=1)
    report(rows)


if __name__ == "__main__":
    main()

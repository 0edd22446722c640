"""python fallbackgate/bench/results/lowbit-vs-baselines-2026-12-06/admission_ab.py SEEDS WORKLOADS RAM OUT.json

Joint three ways, run after run for each seed and workload (the order rotated by seed), so machine drift between
windows cannot enter the comparison: as shipped (exact admission, the sweep's class budgets), lowbit_colder and
lowbit_colder_decode with the best-effort budget opened; against seeds 50-59's SLO targets. Prints per cell the
paired change of each admission against the shipped joint (Student-t 95 % over seeds)."""

import json
import sys
import tempfile

import yaml

from fallbackgate.ledger.db import open_ledger
from fallbackgate.sweep.intervals import interval
from fallbackgate.sweep.regime import RegimeConfig, run_regime
from fallbackgate.sweep.summary import expert_read_bytes
from fallbackgate.tinymoe import CHECKPOINT_DIR

OPEN = yaml.safe_load(open("fallbackgate/bench/results/lowbit-frontier-2026-12-06/best-effort-open.yaml"))
VARIANTS = {"shipped": ("exact", None), "lowbit_colder": ("lowbit_colder", OPEN),
            "lowbit_colder_decode": ("lowbit_colder_decode", OPEN)}  # fmt: skip
METRICS = ("ttft_p50_ms", "tpot_p99_ms", "slo_attainment", "over_min", "lowbit_uses", "mean_kl")


def run(seed: int, workload: str, ram: float, name: str, scratch: str, refs: dict) -> dict:
    admission, budgets = VARIANTS[name]
    cfg = RegimeConfig(model_dir=str(CHECKPOINT_DIR), workloads=(workload,), seeds=(seed,), ram_fracs=(ram,),
                       controllers=("joint",), expert_admission=admission, class_budgets=budgets,
                       slo_from={workload: refs[workload]}, lowbit_dir=f"{scratch}/lowbit")  # fmt: skip
    (point,) = run_regime(cfg, open_ledger(f"sqlite:///{scratch}/ledger.sqlite"), log=lambda line: None)["points"]
    m = point["metrics"]
    return {"seed": seed, "workload": workload, "ram_frac": ram, "variant": name,
            "over_min": expert_read_bytes(m) / m["belady_expert_bytes_same_room"],
            "lowbit_uses": m.get("count_expert_expert_lowbit", 0.0), "gate_passed": m["gate_passed"],
            **{k: m[k] for k in ("ttft_p50_ms", "tpot_p99_ms", "slo_attainment", "mean_kl", "load_avg_1m")},
            }  # fmt: skip


def report(rows: list[dict]) -> None:
    for workload in dict.fromkeys(r["workload"] for r in rows):
        by = {}
        for r in rows:
            if r["workload"] == workload:
                by.setdefault(r["seed"], {})[r["variant"]] = r
        seeds = sorted(by)
        print(f"{workload}@{rows[0]['ram_frac']} n={len(seeds)}")
        for metric in METRICS:
            base = [by[s]["shipped"][metric] for s in seeds]
            mean_base = sum(base) / len(base)
            parts = [f"shipped {mean_base:.3g}"]
            for name in ("lowbit_colder", "lowbit_colder_decode"):
                other = [by[s][name][metric] for s in seeds]
                iv = interval([(o - b) / mean_base for o, b in zip(other, base, strict=True)]) if mean_base else None
                change = f" ({100 * iv['mean']:+.1f} % [{100 * iv['lo']:+.1f}, {100 * iv['hi']:+.1f}])" if iv else ""
                parts.append(f"{name} {sum(other) / len(other):.3g}{change}")
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

"""python fallbackgate/bench/results/lowbit-fastpath-2026-12-06/fastpath_ab.py SEEDS WORKLOADS RAM OUT.json

Joint three ways, run after run for each seed and workload (the order rotated by seed), so machine drift between
windows cannot enter the comparison: as shipped (exact admission, the sweep's class budgets), lowbit_colder with
the best-effort budget opened, and the same lowbit_colder with the low-bit path as it was before this stop
("slowpath": 64-row dequantization chunks through the general path, one expert's rows through the grouped
kernel's sort and scatter, no read-ahead of persisted copies); against seeds 50-59's SLO targets. Prints per
cell the paired change of each variant against the shipped joint, and of lowbit_colder against its slowpath
(Student-t 95 % over seeds)."""

import contextlib
import json
import sys
import tempfile

import torch
import yaml

from fallbackgate.engine.experts import grouped, lowbit_copies, miss_fetch, quant
from fallbackgate.engine.experts.store import ExpertStore
from fallbackgate.ledger.db import open_ledger
from fallbackgate.sweep.intervals import interval
from fallbackgate.sweep.regime import RegimeConfig, run_regime
from fallbackgate.sweep.summary import expert_read_bytes
from fallbackgate.tinymoe import CHECKPOINT_DIR

OPEN = yaml.safe_load(open("fallbackgate/bench/results/lowbit-frontier-2026-12-06/best-effort-open.yaml"))
VARIANTS = {"shipped": ("exact", None, False), "lowbit_colder": ("lowbit_colder", OPEN, False),
            "lowbit_colder_slowpath": ("lowbit_colder", OPEN, True)}  # fmt: skip
METRICS = ("ttft_p50_ms", "tpot_p99_ms", "slo_attainment", "over_min", "lowbit_uses", "mean_kl")


def _slow_rows(module, expert, x, weights):
    slots = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
    return grouped.grouped_rows(module, expert.gate_up[None], expert.down[None], x, slots, weights, 1)


def _slow_dequantized(q, device, dtype):
    return quant._dequantize_padded_rows(quant.quantized_to(q, device), dtype, 64)


@contextlib.contextmanager
def slowpath(is_slow: bool):
    """The low-bit path of 129a167 (before this stop) while the block runs, when `is_slow`."""
    saved = (miss_fetch.single_expert_rows, lowbit_copies.dequantized, ExpertStore.start_lowbit_read)
    if is_slow:
        miss_fetch.single_expert_rows, lowbit_copies.dequantized = _slow_rows, _slow_dequantized
        ExpertStore.start_lowbit_read = lambda self, key: False
    try:
        yield
    finally:
        miss_fetch.single_expert_rows, lowbit_copies.dequantized, ExpertStore.start_lowbit_read = saved


def run(seed: int, workload: str, ram: float, name: str, scratch: str, refs: dict) -> dict:
    admission, budgets, is_slow = VARIANTS[name]
    cfg = RegimeConfig(model_dir=str(CHECKPOINT_DIR), workloads=(workload,), seeds=(seed,), ram_fracs=(ram,),
                       controllers=("joint",), expert_admission=admission, class_budgets=budgets,
                       slo_from={workload: refs[workload]}, lowbit_dir=f"{scratch}/lowbit")  # fmt: skip
    with slowpath(is_slow):
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
            parts.append(f"| fast vs slow {_change(by, seeds, metric, 'lowbit_colder', 'lowbit_colder_slowpath')}")
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

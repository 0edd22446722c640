"""python -m fallbackgate.bench.devices_flip --traces-from DIR [--jobs 2] [--json FILE]

Do devices flip who wins? (PROBE.md question 5, with the project's own controllers.) Over the joint traces that
``bench.validate_cells`` kept (DIR/points.json: every workload, both RAM budgets, its seeds), the trace simulator
runs joint, two independent LRUs and the static split at KV 0.1 / 0.3 / 0.5 at the run's own budget, each on
three device models: this machine's (the waits the trace recorded, as validated), and the two labelled
what-ifs (an NVMe SSD behind PCIe 4, GPU HBM fed over PCIe 5). Per device and cell: each controller's
simulated stall (modeled link time), joint's gain over the best static split of each seed and over two LRUs
(1 − joint / partner, mean and Student-t 95 % interval over the seeds) and the share of seeds joint stalls
least. The compute of every step stays this CPU's, so stall, not TPOT, is what a device changes. Trace-driven:
the schedule is joint's own run's (another controller's run is predicted within the validation bound in 126
of 150 sweep runs). JSON out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

import tqdm

from fallbackgate.bench import write_results
from fallbackgate.sweep.intervals import interval, percent_interval
from fallbackgate.sweep.regime import JOINT
from fallbackgate.tracing.devices import WHAT_IFS, DeviceModel, fit_waits
from fallbackgate.tracing.reader import read_trace
from fallbackgate.tracing.simulate import SimulationConfig
from fallbackgate.tracing.simulate_run import simulate_many
from fallbackgate.tracing.validate import recorded_budget

STATIC_SHARES = (0.1, 0.3, 0.5)  # the sweep's KV shares of the static split
PARTNERS = ("best static", "two LRUs")


def controllers() -> list[tuple[str, str, float | None]]:
    """(label, controller kind, expert fraction) of every configuration simulated per device."""
    statics = [(f"static KV {kv:g}", "static_split", round(1 - kv, 6)) for kv in STATIC_SHARES]
    return [("joint", JOINT, None), ("two LRUs", "independent_lru", None), *statics]


def simulate_cell(path: str, jobs: int) -> dict[str, dict[str, float]]:
    """Per device name, per controller label: the simulated stall (s) and P99 TPOT (ms) over the trace."""
    trace = read_trace(path)
    waits = fit_waits(trace)
    devices: list[DeviceModel] = ([waits] if waits is not None else []) + list(WHAT_IFS)
    budget = recorded_budget(trace)
    configs = [(device, label, SimulationConfig(kind, budget, device, share))
               for device in devices for label, kind, share in controllers()]  # fmt: skip
    results = simulate_many(path, [c for _, _, c in configs], jobs=jobs)
    out: dict[str, dict[str, Any]] = {}
    for (device, label, _), result in zip(configs, results, strict=True):
        if "error" in result:
            raise RuntimeError(f"{path}: {label} on {device.name}: {result['error']}")
        out.setdefault(device.name.split(" ")[0], {})[label] = {"stall_s": result["stall_s"],
                                                                  "p99_tpot_ms": result["p99_tpot_ms"]}  # fmt: skip
    return out


def seed_stalls(by_label: dict[str, dict[str, float]]) -> dict[str, float]:
    """One seed's simulated stalls: joint, the best of its static splits, two LRUs."""
    statics = [v["stall_s"] for k, v in by_label.items() if k.startswith("static")]
    return {"joint": by_label["joint"]["stall_s"], "best static": min(statics),
            "two LRUs": by_label["two LRUs"]["stall_s"]}  # fmt: skip


def summarize(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Per device, per workload@ram: mean stalls and joint's stall gains over the seeds."""
    out: dict[str, Any] = {}
    for cell in cells:
        for device, by_label in cell["devices"].items():
            row = out.setdefault(device, {}).setdefault(f"{cell['workload']}@{cell['ram_frac']:g}", {"seeds": []})
            row["seeds"].append(seed_stalls(by_label))
    for rows in out.values():
        for row in rows.values():
            seeds = row.pop("seeds")
            row["stall_s"] = {k: sum(s[k] for s in seeds) / len(seeds) for k in ("joint", *PARTNERS)}
            for partner in PARTNERS:
                gains = [1 - s["joint"] / s[partner] if s[partner] > 0 else 0.0 for s in seeds]
                row[f"gain_vs_{partner}"] = interval(gains)
            row["joint_least_share"] = sum(s["joint"] <= min(s[p] for p in PARTNERS) for s in seeds) / len(seeds)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m fallbackgate.bench.devices_flip", description=__doc__.splitlines()[2])
    p.add_argument("--traces-from", type=pathlib.Path, required=True, help="bench.validate_cells' --out DIR")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    points = [q for q in json.loads((args.traces_from / "points.json").read_text()) if q["controller"] == JOINT]
    if not points:
        sys.exit(f"devices_flip: {args.traces_from}/points.json names no joint trace")
    cells = []
    for point in tqdm.tqdm(points, unit="trace", file=sys.stderr):
        cell = {k: point[k] for k in ("workload", "seed", "ram_frac", "trace")}
        cells.append({**cell, "devices": simulate_cell(point["trace"], args.jobs)})
    summary = summarize(cells)
    for device, rows in summary.items():
        print(f"{device}: simulated stall per run (s), joint / best static / two LRUs; joint's stall gain over each")
        for name, row in sorted(rows.items()):
            s = row["stall_s"]
            gains = "  ".join(f"{k} {percent_interval(row[f'gain_vs_{k}'])}" for k in PARTNERS)
            print(f"  {name:22s} {s['joint']:.3f} / {s['best static']:.3f} / {s['two LRUs']:.3f}  {gains}  "
                  f"joint least in {row['joint_least_share']:.0%}")  # fmt: skip
    if args.json:
        write_results(args.json, summary=summary, cells=cells)


if __name__ == "__main__":
    main()

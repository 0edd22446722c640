"""python -m fallbackgate.bench.compression_value --sweep SWEEP_JSON [--jobs 2] [--json FILE] [--png FILE]

Does model-side compression shrink or grow the value of joint management? (PROBE.md, "also raised".) Over the
joint traces a sweep kept (``fallbackgate sweep --controllers joint --keep-trace all``: its sweep.json's points
name them), the trace simulator runs joint, two independent LRUs and the static split at KV 0.1 / 0.3 / 0.5 with
the model's experts and / or KV blocks stored smaller (``SimulationConfig.expert_bytes_scale`` / ``kv_bytes_scale``,
fractions of the recorded bytes: the bundled model is recorded in fp32, so 1/2 is bf16 and 1/4 int8 of it; of
a bf16 model they would be int8 and int4), under two budgets:

- *same bytes*: the run's own RAM budget, so compression frees memory;
- *same pressure*: the budget scaled with the compressed demand (all routed experts plus the KV every request
  would hold at its full length), so RAM stays the run's fraction of demand: the saved memory spent again, as
  the probe expects it to be (on longer contexts, more concurrency), with the demand's mix shifted toward the
  kind that was not compressed.

Per device, budget, variant and cell (``workload@ram``): each controller's mean simulated stall, joint's stall
saving over the best static split of each seed and over two LRUs — of the partner's stall (1 − joint / partner)
and of the partner's whole simulated run (its steps end to end: compute, the host time before each step, waits
for arrivals included, and stall) — and, paired seed by seed, how each moved against the model as recorded
(Student-t 95 % over the seeds). Devices: the waits the trace recorded (this machine, as validated) and the
NVMe what-if. Trace-driven, compute as recorded: what compression does to compute (dequantisation) and to
routing is not in it. JSON out; ``--png`` draws joint's relative saving over the best static split per variant.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
from typing import Any

import tqdm

from fallbackgate.bench import write_results
from fallbackgate.bench.devices_flip import PARTNERS, controllers, seed_stalls
from fallbackgate.sweep.intervals import interval, percent_interval
from fallbackgate.sweep.regime import JOINT
from fallbackgate.tracing.devices import NVME_PCIE4, fit_waits
from fallbackgate.tracing.reader import Trace, read_trace
from fallbackgate.tracing.simulate import SimulationConfig
from fallbackgate.tracing.simulate_run import simulate_many
from fallbackgate.tracing.validate import recorded_budget

BASE = "as recorded"
VARIANTS: dict[str, tuple[float, float]] = {  # name -> (expert bytes scale, KV bytes scale)
    BASE: (1.0, 1.0), "experts x1/2": (0.5, 1.0), "experts x1/4": (0.25, 1.0), "KV x1/2": (1.0, 0.5),
    "both x1/2": (0.5, 0.5),
}  # fmt: skip
SAME_BYTES, SAME_PRESSURE = "same bytes", "same pressure"


def budget_bytes(point: dict[str, Any], recorded: int, scales: tuple[float, float], regime: str) -> int:
    """The device budget of one configuration: the run's own, or (same pressure) scaled as its demand is."""
    if regime == SAME_BYTES:
        return recorded
    kv = float(point["kv_demand_bytes"])
    experts = float(point["demand_bytes"]) - kv
    return int(recorded * (scales[0] * experts + scales[1] * kv) / (experts + kv))


def plan(point: dict[str, Any], trace: Trace) -> list[tuple[str, str, str, SimulationConfig]]:
    """(regime, variant, controller label, configuration) of one trace: every variant under both budgets (the
    model as recorded once: its budget is the same under both), every controller, on both devices."""
    recorded = int(recorded_budget(trace))
    devices = [d for d in (fit_waits(trace), NVME_PCIE4) if d is not None]
    out = []
    for name, scales in VARIANTS.items():
        for regime in (SAME_BYTES,) if name == BASE else (SAME_BYTES, SAME_PRESSURE):
            budget = budget_bytes(point, recorded, scales, regime)
            for device in devices:
                for label, kind, share in controllers():
                    out.append((regime, name, label, SimulationConfig(kind, budget, device, share, *scales)))
    return out


def simulate_cell(point: dict[str, Any], jobs: int) -> dict[str, Any]:
    """Per device, regime and variant, per controller label: simulated stall (s) and P99 TPOT (ms)."""
    path = point["trace"]
    configs = plan(point, read_trace(path))
    results = simulate_many(path, [c for *_, c in configs], jobs=jobs)
    out: dict[str, Any] = {}
    for (regime, name, label, config), result in zip(configs, results, strict=True):
        if "error" in result:
            raise RuntimeError(f"{path}: {label} {name} {regime} on {config.device.name}: {result['error']}")
        device = config.device.name.split(" ")[0]
        out.setdefault(device, {}).setdefault(regime, {}).setdefault(name, {})[label] = {
            "stall_s": result["stall_s"], "run_s": result["run_s"], "p99_tpot_ms": result["p99_tpot_ms"],
            "budget_bytes": config.budget_bytes}  # fmt: skip
    for regimes in out.values():
        regimes[SAME_PRESSURE] = {BASE: regimes[SAME_BYTES][BASE]} | regimes[SAME_PRESSURE]
    return out


def seed_row(by_label: dict[str, dict[str, float]]) -> dict[str, float]:
    """One seed's stalls (:func:`~fallbackgate.bench.devices_flip.seed_stalls`) and joint's run time without
    its stall."""
    joint = by_label["joint"]
    return seed_stalls(by_label) | {"unstalled_s": joint["run_s"] - joint["stall_s"]}


def _relative(row: dict[str, float], partner: str) -> float:
    """Joint's stall saving as a fraction of the partner's stall (NaN, left out, where only joint stalls)."""
    if row[partner] > 0:
        return 1 - row["joint"] / row[partner]
    return 0.0 if row["joint"] == 0 else math.nan


def _of_run(row: dict[str, float], partner: str) -> float:
    """Joint's stall saving as a fraction of the partner's whole run (its stall and the unstalled time)."""
    return (row[partner] - row["joint"]) / (row["unstalled_s"] + row[partner])


def _order(key: tuple[str, str, str, str]) -> tuple:
    """(device, regime, variant in VARIANTS' order, cell): the summary's order."""
    device, regime, variant, name = key
    return device, regime, list(VARIANTS).index(variant), name


def summarize(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Per device, regime, variant and cell: mean stalls, joint's relative and absolute savings over each
    partner, and their paired change against the uncompressed model over the seeds."""
    seeds: dict[tuple[str, str, str, str], dict[int, dict[str, float]]] = {}
    for cell in cells:
        name = f"{cell['workload']}@{cell['ram_frac']:g}"
        for device, regimes in cell["devices"].items():
            for regime, variants in regimes.items():
                for variant, by_label in variants.items():
                    seeds.setdefault((device, regime, variant, name), {})[cell["seed"]] = seed_row(by_label)
    out: dict[str, Any] = {}
    for (device, regime, variant, name), by_seed in sorted(seeds.items(), key=lambda item: _order(item[0])):
        base = seeds[(device, regime, BASE, name)]
        rows = [by_seed[s] for s in sorted(by_seed)]
        stall = {k: sum(r[k] for r in rows) / len(rows) for k in ("joint", *PARTNERS)}
        entry: dict[str, Any] = {"n": len(rows), "stall_s": stall,
                                 "unstalled_s": sum(r["unstalled_s"] for r in rows) / len(rows)}  # fmt: skip
        entry["stall_share_of_run"] = sum(r["joint"] / (r["joint"] + r["unstalled_s"]) for r in rows) / len(rows)
        paired = sorted(set(by_seed) & set(base))
        for partner in PARTNERS:
            for measure, fn in (("saving", _relative), ("run_saving", _of_run)):
                entry[f"{measure}_vs_{partner}"] = interval([fn(r, partner) for r in rows])
                if variant != BASE:
                    moved = [fn(by_seed[s], partner) - fn(base[s], partner) for s in paired]
                    entry[f"{measure}_change_vs_{partner}"] = interval(moved)
        out.setdefault(device, {}).setdefault(regime, {}).setdefault(variant, {})[name] = entry
    return out


def report_lines(summary: dict[str, Any]) -> list[str]:
    """The summary as text: per device and budget, a line per variant and cell."""
    lines = []
    for device, regimes in summary.items():
        for regime, variants in regimes.items():
            lines.append(f"{device}, {regime}: stall per run (s) joint / best static / two LRUs, joint's stall "
                         "share of its run; joint's saving over the best static split, of its stall and of its "
                         "whole run (each one's change against the model as recorded, points)")  # fmt: skip
            for variant, cells in variants.items():
                for name, e in cells.items():
                    s = e["stall_s"]
                    parts = [f"stall {percent_interval(e['saving_vs_best static'], 1)}",
                             f"run {percent_interval(e['run_saving_vs_best static'], 1)}"]  # fmt: skip
                    if variant != BASE:
                        parts[0] += f" ({percent_interval(e['saving_change_vs_best static'], 1)})"
                        parts[1] += f" ({percent_interval(e['run_saving_change_vs_best static'], 1)})"
                    lines.append(
                        f"  {variant:13s} {name:22s} {s['joint']:.3f} / {s['best static']:.3f} / "
                        f"{s['two LRUs']:.3f} {e['stall_share_of_run']:4.0%}  " + "  ".join(parts)
                    )
    return lines


def plot_savings(summary: dict[str, Any], path: str, device: str = "waits") -> None:
    """Joint's relative stall saving over the best static split (top) and two LRUs (bottom) per cell, a bar per
    variant with its 95 % interval, one column per budget; on `device` (the recorded waits)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    regimes = summary[device]
    fig, axes = plt.subplots(2, len(regimes), figsize=(7 * len(regimes), 8), sharey="row", squeeze=False)
    for col, (regime, variants) in enumerate(regimes.items()):
        names = sorted(next(iter(variants.values())))
        width = 0.8 / len(variants)
        for row, partner in enumerate(PARTNERS):
            ax = axes[row][col]
            for i, (variant, cells) in enumerate(variants.items()):
                ivs = [cells[n][f"saving_vs_{partner}"] for n in names]
                means = [100 * iv["mean"] for iv in ivs]
                errors = [100 * (iv["hi"] - iv["mean"]) for iv in ivs]
                ax.bar([x + i * width for x in range(len(names))], means, width, yerr=errors, label=variant)
            ax.axhline(0, color="black", linewidth=0.5)
            ax.set_xticks([x + 0.4 - width / 2 for x in range(len(names))], names, rotation=40, ha="right")
            ax.set_title(f"{regime}: joint's stall saving over {partner}")
            ax.set_ylabel("% of the partner's stall (simulated)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m fallbackgate.bench.compression_value",
                                description=__doc__.split("\n\n")[1])  # fmt: skip
    p.add_argument("--sweep", type=pathlib.Path, required=True, help="sweep.json of a sweep that kept joint traces")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None, help="figure: joint's saving over the best static split per variant")
    args = p.parse_args(argv)
    points = [q for q in json.loads(args.sweep.read_text())["points"] if q["controller"] == JOINT and q.get("trace")]
    if not points:
        sys.exit(f"compression_value: {args.sweep} names no kept joint trace")
    cells = []
    for point in tqdm.tqdm(points, unit="trace", file=sys.stderr):
        cell = {k: point[k] for k in ("workload", "seed", "ram_frac", "trace")}
        cells.append({**cell, "devices": simulate_cell(point, args.jobs)})
    summary = summarize(cells)
    print("\n".join(report_lines(summary)))
    if args.json:
        write_results(args.json, summary=summary, cells=cells, variants=VARIANTS)
    if args.png:
        plot_savings(summary, args.png)


if __name__ == "__main__":
    main()

"""python -m fallbackgate.bench.ssd_sharing --trace DIR [--trace DIR ...] --dir SCRATCH [--controllers A,B]
    [--expert-fraction F] [--kv-scale F] [--budget-scale F] [--workers N] [--repeats R] [--no-pace]
    [--layouts A,B] [--json FILE] [--png FILE]

How should read-only experts and append-only KV pages share one SSD? (PROBE.md, "also raised".) Each trace's
recorded run is decided again by each controller (``trace simulate``'s simulator, the trace's own budget), and
its transfers -- demand reads of experts and KV blocks, step-end expert prefetches, KV spill writes -- are
performed for real against a scratch file in SCRATCH (``trace simulate --io real``, ``tracing.realio``) under
each way of sharing the device:

- ``priority/shared``: one queue, waited-on reads before queued prefetches and spill writes (the engine's);
- ``fifo/shared``: one queue in submission order (a spill write queued first delays the next miss);
- ``priority/by_kind`` and ``fifo/by_kind``: experts and KV blocks a queue each, half the workers each (two
  independent links, as two independent controllers would own them);
- ``priority/shared/1``: the control for by_kind: one queue with one worker, what each kind has there.

Every (trace, controller) runs every layout ``--repeats`` times, the layouts' order rotated each repeat: with
``--repeats`` equal to the number of layouts each layout takes each place once, so drift of the disk over a cell
falls on all of them alike (fewer repeats leave the places unbalanced). Per layout: the summed stall (the wall time the
steps waited on their demand reads), P99 and mean TPOT as the simulator prices them with that stall, read
latency (submission to arrival) by kind, and the bytes moved by kind and direction; each layout's stall and P99
TPOT as a ratio to ``priority/shared`` of the same repeat, with their mean over repeats and traces. JSON out;
``--png`` draws the stall ratios. ``--kv-scale F`` (above 1) is the simulator's larger-KV what-if: every KV block
F times its recorded bytes, in room and on the disk (a model with F times the KV bytes per token against its
experts, serving the same accesses), so KV moves a larger share of the bytes; ``--budget-scale F`` gives it F
times each trace's recorded budget, so that one layer's K/V of the batch still fits (a configuration where it
does not is refused before any real transfer, from its decisions alone: the engine could not serve it,
``num_unfit_gathers``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

import numpy as np

from fallbackgate.sweep.intervals import interval
from fallbackgate.tracing.devices import fit_waits
from fallbackgate.tracing.reader import read_trace
from fallbackgate.tracing.realio import ORDERS, QUEUES, RealIO, simulate_real
from fallbackgate.tracing.simulate import SimulationConfig
from fallbackgate.tracing.simulate_input import SimulationInput, load_input
from fallbackgate.tracing.simulator import Simulator
from fallbackgate.tracing.validate import recorded_budget

LAYOUTS = [(order, queues) for queues in QUEUES for order in ORDERS]  # priority/shared first: the reference
LAYOUTS.append(("priority", "shared/1"))  # control: one queue with ONE worker (by_kind's per-kind share)
REFERENCE = "priority/shared"
KEPT = ("stall_s", "p99_tpot_ms", "mean_tpot_ms", "demand_read_latency_ms_by_kind", "bytes_moved", "num_reads",
        "io_workers", "num_writes", "is_direct", "num_unfit_gathers")  # fmt: skip


def layout_name(order: str, queues: str) -> str:
    """``order/queues``, e.g. ``priority/shared``."""
    return f"{order}/{queues}"


def chosen_layouts(names: str | None) -> list[tuple[str, str]]:
    """The layouts a ``--layouts`` list names (default: all), the reference always first."""
    if not names:
        return list(LAYOUTS)
    wanted = {n.strip() for n in names.split(",") if n.strip()} | {REFERENCE}
    known = {layout_name(o, q) for o, q in LAYOUTS}
    if wanted - known:
        raise ValueError(f"--layouts: unknown {', '.join(sorted(wanted - known))}; known: {', '.join(sorted(known))}")
    return [(o, q) for o, q in LAYOUTS if layout_name(o, q) in wanted]


def real_ios(args: argparse.Namespace) -> list[tuple[str, RealIO]]:
    """Each chosen layout's name and I/O settings (ValueError for a bad list or a bad worker count)."""
    ios = []
    for order, queues in chosen_layouts(args.layouts):
        workers = 1 if queues == "shared/1" else args.workers
        real = RealIO(args.dir, pace=not args.no_pace, order=order, queues=queues.split("/")[0], workers=workers)
        ios.append((layout_name(order, queues), real))
    return ios


def run_cell(trace: str, config: SimulationConfig, ios: list[tuple[str, RealIO]], repeat: int) -> dict[str, Any]:
    """One (trace, controller) repeat: every layout, in an order rotated by `repeat`."""
    shift = repeat % len(ios)
    out: dict[str, Any] = {}
    for name, real in ios[shift:] + ios[:shift]:
        result = simulate_real(trace, [config], real)[0]
        if result["num_unfit_gathers"]:  # check_servable refused it before: the decisions differ
            raise RuntimeError(f"{trace} {config.controller}: {result['num_unfit_gathers']} unfit layer gathers in a "
                               "real run that the modelled pass found servable")  # fmt: skip
        out[name] = {k: result.get(k) for k in KEPT}
    out = {name: out[name] for name, _ in ios}  # reported in one order
    reference = out[REFERENCE]
    for metrics in out.values():
        metrics["stall_ratio"] = metrics["stall_s"] / reference["stall_s"] if reference["stall_s"] else None
        metrics["p99_tpot_ratio"] = metrics["p99_tpot_ms"] / reference["p99_tpot_ms"]
    return out


def num_unfit_gathers(data: SimulationInput, config: SimulationConfig) -> int:
    """The layer gathers of `config`'s decisions over a trace's `data` that do not fit its budget, from the
    decisions alone (no transfer): the same decisions every real run of it makes, in every layout."""
    simulator = Simulator(data, config)
    simulator.decide()
    return simulator.tally.num_unfit_gathers


def check_servable(trace: str, configs: list[SimulationConfig]) -> None:
    """Refuse (ValueError), before any real transfer, a configuration the engine could not serve: one whose
    layer gathers do not fit the budget. A controller that fails raises as it would in a real run."""
    data = load_input(trace)
    for config in configs:
        unfit = num_unfit_gathers(data, config)
        if unfit:
            raise ValueError(f"{trace} {config.controller}: {unfit} layer gathers did not fit the budget at "
                             f"--kv-scale {config.kv_bytes_scale:g}: the engine could not serve it")  # fmt: skip


def summarize(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Per layout: the stall and P99 TPOT ratios' mean and range over every (trace, controller, repeat) cell,
    and per controller a Student-t 95 % interval over the traces of each trace's mean ratio (the repeats of a
    trace are not independent draws; its traces are)."""
    summary = {}
    for order, queues in LAYOUTS:
        name = layout_name(order, queues)
        if any(name not in c["layouts"] for c in cells):
            continue
        stall = [c["layouts"][name]["stall_ratio"] for c in cells if c["layouts"][name]["stall_ratio"] is not None]
        p99 = [c["layouts"][name]["p99_tpot_ratio"] for c in cells]
        summary[name] = {
            "stall_ratio_mean": float(np.mean(stall)) if stall else None,
            "stall_ratio_range": [float(min(stall)), float(max(stall))] if stall else None,
            "p99_tpot_ratio_mean": float(np.mean(p99)),
            "p99_tpot_ratio_range": [float(min(p99)), float(max(p99))],
            "num_cells": len(p99),
            "by_controller": {c: _over_traces(cells, name, c) for c in sorted({c["controller"] for c in cells})},
        }
    return summary


def _over_traces(cells: list[dict[str, Any]], name: str, controller: str) -> dict[str, Any]:
    by_trace: dict[str, list[dict[str, Any]]] = {}
    for cell in cells:
        if cell["controller"] == controller:
            by_trace.setdefault(cell["trace"], []).append(cell["layouts"][name])
    stall = [float(np.mean([m["stall_ratio"] for m in ms if m["stall_ratio"] is not None])) for ms in by_trace.values()]
    p99 = [float(np.mean([m["p99_tpot_ratio"] for m in ms])) for ms in by_trace.values()]
    return {"stall_ratio": interval(stall), "p99_tpot_ratio": interval(p99)}


def kv_share(cells: list[dict[str, Any]], controller: str | None = None) -> float:
    """The KV blocks' share of all bytes moved over the link (reference layout; every cell, or `controller`'s)."""
    moved = [c["layouts"][REFERENCE]["bytes_moved"] for c in cells if controller in (None, c["controller"])]
    kv = sum(v for m in moved for k, v in m.items() if k.startswith("kv_block"))
    total = sum(v for m in moved for v in m.values())
    return kv / total if total else 0.0


def draw(cells: list[dict[str, Any]], path: str) -> None:
    """Each cell's stall ratio per layout (against priority/shared)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [layout_name(o, q) for o, q in LAYOUTS if all(layout_name(o, q) in c["layouts"] for c in cells)]
    fig, ax = plt.subplots(figsize=(8, 4))
    for cell in cells:
        ratios = [cell["layouts"][n]["stall_ratio"] or np.nan for n in names]
        ax.plot(names, ratios, marker="o", alpha=0.6, label=f"{cell['trace']} {cell['controller']} r{cell['repeat']}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("stall / priority-shared's (same cell, same repeat)")
    ax.set_title("Experts and KV on one disk: the device's queue order and sharing (measured I/O)")
    ax.legend(fontsize=5, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _configs(trace: str, controllers: list[str], args: argparse.Namespace) -> list[SimulationConfig]:
    """Each controller at the trace's recorded budget (times ``--budget-scale``), deciding with the device its
    own waits fit."""
    recorded = read_trace(trace)
    budget, device = recorded_budget(recorded), fit_waits(recorded)
    if not budget or device is None:
        raise ValueError(f"{trace}: no recorded budget or no waits to fit a device model from")
    if args.budget_scale <= 0:
        raise ValueError(f"--budget-scale must be positive, got {args.budget_scale:g}")
    budget, fraction = int(budget * args.budget_scale), {"static_split": args.expert_fraction}
    return [SimulationConfig(c, budget, device, fraction.get(c), kv_bytes_scale=args.kv_scale) for c in controllers]


def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (trace, controller, repeat) cell, printed as it finishes."""
    if not pathlib.Path(args.dir).is_dir():
        raise ValueError(f"--dir {args.dir}: not a directory")
    controllers = [c.strip() for c in args.controllers.split(",") if c.strip()]
    ios = real_ios(args)
    configs = {trace: _configs(trace, controllers, args) for trace in args.trace}
    for trace, trace_configs in configs.items():
        check_servable(trace, trace_configs)
    cells = []
    for trace in args.trace:
        name = pathlib.Path(trace).name
        for config in configs[trace]:
            for repeat in range(args.repeats):
                layouts = run_cell(trace, config, ios, repeat)
                cells.append({"trace": name, "controller": config.controller, "repeat": repeat, "layouts": layouts})
                ratios = "  ".join(f"{n} x{m['stall_ratio'] or 0:.3f}" for n, m in layouts.items())
                stall = layouts[REFERENCE]["stall_s"]
                print(f"{name} {config.controller} r{repeat}: stall {stall:.3f} s; {ratios}", flush=True)
    return cells


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fallbackgate.bench.ssd_sharing", description=__doc__)
    parser.add_argument("--trace", action="append", required=True, help="a trace directory (repeatable)")
    parser.add_argument("--dir", required=True, help="a directory on the disk under test (tmpfs: RAM)")
    parser.add_argument("--controllers", default="joint,static_split", help="comma-separated")
    parser.add_argument("--expert-fraction", type=float, default=0.9, help="static_split's expert share")
    parser.add_argument("--kv-scale", type=float, default=1.0, help="KV blocks at F times their recorded bytes")
    parser.add_argument("--budget-scale", type=float, default=1.0, help="F times each trace's recorded budget")
    parser.add_argument("--workers", type=int, default=2, help="transfers in flight in all (by_kind: half each)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every layout per cell")
    parser.add_argument("--no-pace", action="store_true", help="do not sleep each step's compute time")
    parser.add_argument("--layouts", default=None, help="comma-separated (default: all; priority/shared always)")
    parser.add_argument("--json", default=None, help="results file")
    parser.add_argument("--png", default=None, help="figure of the stall ratios")
    parser.add_argument(
        "--summarize",
        metavar="JSON",
        default=None,
        help="summarize an earlier run's results file again (nothing is run; with --json: rewritten)",
    )
    args = parser.parse_args(argv)
    try:
        if args.summarize:
            if (args.kv_scale, args.budget_scale) != (1.0, 1.0):
                raise ValueError("--summarize runs nothing: its scales are the results file's, not --kv-scale or "
                                 "--budget-scale")  # fmt: skip
            earlier = json.loads(pathlib.Path(args.summarize).read_text())
            command, cells = earlier["command"], earlier["cells"]
            scales = earlier.get("kv_bytes_scale", 1.0), earlier.get("budget_scale", 1.0)
        else:
            command, cells, scales = " ".join(sys.argv), run_all(args), (args.kv_scale, args.budget_scale)
    except (ValueError, FileNotFoundError, KeyError, json.JSONDecodeError) as exc:
        print(f"ssd_sharing: {exc}", file=sys.stderr)
        return 2
    result = {"command": command, "cells": cells, "summary": summarize(cells)}
    result["kv_share_of_bytes"] = kv_share(cells)
    controllers = sorted({c["controller"] for c in cells})
    result["kv_share_of_bytes_by_controller"] = {c: kv_share(cells, c) for c in controllers}
    result["kv_bytes_scale"], result["budget_scale"] = scales
    for name, s in result["summary"].items():
        for controller, over in s["by_controller"].items():
            st, pt = over["stall_ratio"], over["p99_tpot_ratio"]
            print(f"{name:18} {controller:13} stall x{st['mean']:.3f} [{st['lo']:.3f}, {st['hi']:.3f}]  "
                  f"P99 TPOT x{pt['mean']:.3f} [{pt['lo']:.3f}, {pt['hi']:.3f}]  (n={st['n']} traces)")  # fmt: skip
    by = ", ".join(f"{c} {v:.4f}" for c, v in result["kv_share_of_bytes_by_controller"].items())
    print(f"KV share of the bytes moved: {result['kv_share_of_bytes']:.4f} ({by})")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    if args.png:
        draw(cells, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

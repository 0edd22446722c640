"""python -m fallbackgate.bench.validate_cells --slo-from SWEEP_JSON --seeds 60,61,62 --out DIR
       [--workloads mixed,...] [--traces-from DIR] [--json FILE]

Does the trace simulator predict the sweep's own runs? Runs every cell of the RAM-and-disk sweep (every
workload, controller and budget; ``fallbackgate.sweep.regime``: recorded, audited, gated) for the given
seeds against the SLO targets of ``--slo-from``, keeps every cell's trace under ``DIR/traces`` (the points in
``DIR/points.json``; ``--traces-from DIR`` validates those again without running), then validates each trace
(``fallbackgate trace validate``: its own controller and budget, simulated over its accesses, against the
stall and mean TPOT it measured, bound max(25 %, 1 ms per step)) on three device models: the waits fitted on
the trace itself, the waits fitted on the same cell at the next seed (held out), and the profile's engine I/O
path; and a prediction of a run the simulation never saw: the cell's controller, budget and split simulated
over another controller's trace of the same requests and budget (joint's; for joint, the static split at KV
0.3), with the waits fitted on that trace. Per controller and device: cells within the bound, and the mean
signed error of stall and TPOT with Student-t 95 % intervals over the cells. JSON out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

import tqdm

from fallbackgate.bench import write_results
from fallbackgate.ledger.db import open_ledger
from fallbackgate.sweep.intervals import interval, percent_interval
from fallbackgate.sweep.regime import JOINT, KEEP_ALL, STATIC, RegimeConfig, run_regime
from fallbackgate.tinymoe import CHECKPOINT_DIR
from fallbackgate.tracing.devices import fit_profile
from fallbackgate.tracing.reader import read_trace
from fallbackgate.tracing.validate import validate

WORKLOADS = "mixed,short-chat,long-retrieval,multi-turn,long-reasoning"
DEVICES = ("waits, own", "waits, held out", "profile", "another controller's run")


def run_cells(slo_from: pathlib.Path, workloads: tuple[str, ...], seeds: tuple[int, ...], out: pathlib.Path) -> list:
    """Every cell of the sweep grid for `seeds`, each trace kept; the points (also written to out/points.json)."""
    references = json.loads(slo_from.read_text())["slo_references"]
    missing = [w for w in workloads if w not in references]
    if missing:
        sys.exit(f"validate_cells: {slo_from} has no SLO reference for {missing}")
    out.mkdir(parents=True, exist_ok=True)
    cfg = RegimeConfig(
        model_dir=str(CHECKPOINT_DIR), workloads=workloads, seeds=seeds, slo_from={w: references[w] for w in workloads},
        keep_traces=(KEEP_ALL,), trace_out=str(out / "traces"), lowbit_dir=str(out / "lowbit"),
    )  # fmt: skip
    result = run_regime(cfg, open_ledger(f"sqlite:///{out}/ledger.sqlite"))
    (out / "points.json").write_text(json.dumps(result["points"], indent=1))
    return result["points"]


def _cell(point: dict[str, Any]) -> tuple:
    return point["workload"], point["controller"], point["ram_frac"], point["kv_share"]


def validate_points(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per trace × device: the cell, the device and validate()'s errors and verdicts."""
    seeds = sorted({p["seed"] for p in points})
    by_cell = {(_cell(p), p["seed"]): p["trace"] for p in points}
    rows = []
    for point in tqdm.tqdm(points, unit="trace", file=sys.stderr):
        path = point["trace"]
        other = seeds[(seeds.index(point["seed"]) + 1) % len(seeds)]
        held_out = by_cell.get((_cell(point), other)) if other != point["seed"] else None
        source = by_cell.get((_source_cell(point), point["seed"]))
        for device in DEVICES:
            if (device == "waits, held out" and held_out is None) or (device == DEVICES[3] and source is None):
                continue
            try:
                if device == "profile":
                    model = fit_profile(read_trace(path))
                    result = validate(path, device=model) if model is not None else None
                elif device == DEVICES[3]:
                    result = validate(source, target=path)
                else:
                    result = validate(path, held_out if device == "waits, held out" else None)
            except Exception as exc:  # a trace the simulator cannot take is a row, not the end of the bench
                rows.append({**_key(point), "device": device, "error": f"{type(exc).__name__}: {exc}"})
                continue
            if result is not None:
                rows.append({**_key(point), "device": device, **{k: result[k] for k in (
                    "stall_error", "tpot_error", "stall_within", "tpot_within", "within_bound", "measured",
                    "predicted", "misses_by_tag")}})  # fmt: skip
    return rows


def _source_cell(point: dict[str, Any]) -> tuple:
    """The cell whose trace predicts this one's run: joint's, or for joint the static split at KV 0.3."""
    if point["controller"] == JOINT:
        return point["workload"], STATIC, point["ram_frac"], 0.3
    return point["workload"], JOINT, point["ram_frac"], None


def _key(point: dict[str, Any]) -> dict[str, Any]:
    return {k: point[k] for k in ("workload", "seed", "controller", "ram_frac", "kv_share", "trace")}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per device, and per device × controller: cells within the bound and the errors' intervals."""
    out: dict[str, Any] = {}
    for device in DEVICES:
        mine = [r for r in rows if r["device"] == device and "error" not in r]
        kinds = sorted({r["controller"] for r in mine})
        groups = {"all": mine} | {c: [r for r in mine if r["controller"] == c] for c in kinds}
        out[device] = {
            name: {
                "n": len(group), "within": sum(r["within_bound"] for r in group),
                "stall_within": sum(r["stall_within"] for r in group),
                "tpot_within": sum(r["tpot_within"] for r in group),
                "stall_error": interval([r["stall_error"] for r in group]),
                "tpot_error": interval([r["tpot_error"] for r in group]),
            }
            for name, group in groups.items() if group
        }  # fmt: skip
        out[device]["failed"] = sum(1 for r in rows if r["device"] == device and "error" in r)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m fallbackgate.bench.validate_cells", description=__doc__.splitlines()[3])
    p.add_argument("--slo-from", type=pathlib.Path, help="sweep.json whose SLO targets the runs use")
    p.add_argument("--seeds", default="60,61,62")
    p.add_argument("--workloads", default=WORKLOADS)
    p.add_argument("--out", type=pathlib.Path, help="where traces, points.json and the ledger go")
    p.add_argument("--traces-from", type=pathlib.Path, default=None, help="validate DIR/points.json's traces again")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.traces_from is not None:
        points = json.loads((args.traces_from / "points.json").read_text())
    elif args.slo_from is None or args.out is None:
        p.error("--slo-from and --out are needed unless --traces-from is given")
    else:
        seeds = tuple(int(s) for s in args.seeds.split(","))
        points = run_cells(args.slo_from, tuple(args.workloads.split(",")), seeds, args.out)
    rows = validate_points(points)
    summary = summarize(rows)
    for device, groups in summary.items():
        print(f"{device}: {groups['failed']} traces the simulator could not take")
        for name, g in ((n, g) for n, g in groups.items() if n != "failed"):
            s, t = g["stall_error"], g["tpot_error"]
            print(f"  {name:16s} within {g['within']:3d}/{g['n']:3d} "
                  f"(stall {g['stall_within']}, TPOT {g['tpot_within']})"
                  f"  stall error {percent_interval(s, 1)}  TPOT error {percent_interval(t, 1)}")  # fmt: skip
    if args.json:
        write_results(args.json, summary=summary, rows=rows)


if __name__ == "__main__":
    main()

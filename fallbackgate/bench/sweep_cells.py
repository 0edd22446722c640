"""python -m fallbackgate.bench.sweep_cells --model DIR --json FILE [--cgroup-mb 8192] [--ram-budget-mb 4096]
                                           [--cells WORKLOAD/CONTROLLER[/kvS] ...] [--max-model-len 1536]
                                           [--num-requests 3] [--max-new-tokens 32] [--ledger URL] [--quick]

Named cells of the RAM-and-disk sweep (``fallbackgate sweep``'s cells, :mod:`fallbackgate.sweep.regime`) on a
checkpoint larger than memory (e.g. ``python -m fallbackgate.synth --like olmoe-1b-7b --out DIR``, 13.5 GB in
bf16), each inside a memory cgroup of ``--cgroup-mb`` (page cache included; root and cgroup v1 needed).
Every controller gets the same RAM budget (``--ram-budget-mb``) and serves the same requests (the workload's
generator from ``--seed``, answers capped at ``--max-new-tokens`` <= 64, arrivals honoured); each run is a
ledger run, audited against the exact baseline, gated and traced, exactly as in the sweep.

Per workload, one all-in-RAM exact run outside the cgroup sets the SLO targets (1.5x its p50 TTFT / TPOT,
as the sweep does). Per cell: tokens/s, TTFT and TPOT p50/p99, SLO attainment, expert and KV miss rates,
bytes by tag and by I/O tier, stall seconds, the audited quality cost, Belady's MIN per kind at the run's
split and at its own expert room, FOO's LP bound, the cgroup's peak, and the kernel's count of bytes read
while serving (``/proc/PID/io``) against the bytes the run's I/O says it read. Every cell runs in its own
process, the checkpoint's page cache dropped first. Random weights: the cells speak to memory, bytes and
time; routing and quality conclusions come from the bundled trained model (``fallbackgate sweep``).
``--quick``: a small checkpoint (e.g. ``--num-layers 1``), 2 requests of 8 new tokens, two cells.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
from typing import Any

from fallbackgate.bench.scale import GIB, Cgroup, cannot_run
from fallbackgate.bench.scale_child import drop_page_cache
from fallbackgate.sweep.regime import INDEPENDENT, JOINT, STATIC, RegimeConfig
from fallbackgate.sweep.summary import expert_read_bytes
from fallbackgate.workloads.kinds import WorkloadKind

DEFAULT_CELLS = tuple(
    f"{workload}/{controller}"
    for workload in ("long-retrieval", "mixed")
    for controller in (f"{STATIC}/kv0.1", f"{STATIC}/kv0.3", INDEPENDENT, JOINT)
)
QUICK_CELLS = (f"long-retrieval/{INDEPENDENT}", f"long-retrieval/{JOINT}")
CONTROLLERS = (STATIC, INDEPENDENT, JOINT)


@dataclasses.dataclass(frozen=True, slots=True)
class NamedCell:
    """``<workload>/<controller>`` or ``<workload>/static_split/kv<share>``."""

    workload: str
    controller: str
    kv_share: float | None

    @property
    def name(self) -> str:
        share = "" if self.kv_share is None else f"/kv{self.kv_share:g}"
        return f"{self.workload}/{self.controller}{share}"


def parse_cell(text: str) -> NamedCell:
    """A cell from its name (ValueError with what is wrong)."""
    parts = text.strip().split("/")
    kinds = [k.value for k in WorkloadKind]
    if len(parts) not in (2, 3) or parts[0] not in kinds or parts[1] not in CONTROLLERS:
        raise ValueError(f"cell {text!r}: expected WORKLOAD/CONTROLLER[/kvS], workloads {kinds}, "
                         f"controllers {list(CONTROLLERS)}")  # fmt: skip
    if (parts[1] == STATIC) != (len(parts) == 3):
        raise ValueError(f"cell {text!r}: static_split needs a KV share (…/static_split/kv0.3); the others none")
    share = None
    if len(parts) == 3:
        try:
            share = float(parts[2].removeprefix("kv"))
        except ValueError:
            raise ValueError(f"cell {text!r}: KV share {parts[2]!r} is not kv<fraction>") from None
        if not 0 < share < 1:
            raise ValueError(f"cell {text!r}: KV share must be in (0, 1)")
    return NamedCell(parts[0], parts[1], share)


def run_child(mode: str, spec: dict[str, Any], model: str, cgroup: Cgroup | None) -> dict[str, Any]:
    """Run :mod:`fallbackgate.bench.sweep_cells_child` in a fresh process (in `cgroup` when given)."""
    with tempfile.TemporaryDirectory(prefix="fg-cells-") as scratch:
        spec_path, out_path = pathlib.Path(scratch) / "spec.json", pathlib.Path(scratch) / "out.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [sys.executable, "-m", "fallbackgate.bench.sweep_cells_child", mode, str(spec_path), str(out_path)]
        drop_page_cache(model)
        if cgroup is not None:
            cgroup.reset_peak()
            cmd = ["bash", "-c", f'echo $$ > {cgroup.path}/cgroup.procs && exec "$@"', "bash", *cmd]
        done = subprocess.run(cmd, check=False)
        result = json.loads(out_path.read_text()) if done.returncode == 0 and out_path.is_file() else {}
    result["exit_status"] = done.returncode
    if cgroup is not None:
        result["cgroup_peak_bytes"] = cgroup.peak_bytes()
    return result


def cell_summary(point: dict[str, Any]) -> dict[str, Any]:
    """The numbers of one cell a reader compares (times measured wall clock, bytes in GiB)."""
    m = point["metrics"]
    keys = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "slo_attainment",
            "expert_miss_rate", "kv_miss_rate", "stall_expert_s", "stall_kv_s", "dual_miss_steps", "mean_kl",
            "gate_passed")  # fmt: skip
    out: dict[str, Any] = {k: m.get(k) for k in keys}
    out["read_gib"] = m["read_bytes"] / GIB
    out["io_read_gib"] = m["io_read_bytes"] / GIB
    out["kernel_read_gib"] = m["kernel_read_bytes_serve"] / GIB
    out["kernel_over_io_read"] = m["kernel_read_bytes_serve"] / m["io_read_bytes"] if m["io_read_bytes"] else None
    out["io_write_gib"] = m["io_write_bytes"] / GIB
    out["expert_read_over_belady_same_room"] = _ratio(expert_read_bytes(m), m.get("belady_expert_bytes_same_room"))
    out["read_over_foo"] = _ratio(m["read_bytes"], m.get("foo_lb_bytes"))
    out["cgroup_peak_gib"] = point["cgroup_peak_bytes"] / GIB
    out["peak_kv_pool_gib"] = m.get("peak_pool_by_kind", {}).get("kv_block", 0) / GIB
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def comparisons(cells: dict[str, dict[str, Any]], workload: str) -> dict[str, Any]:
    """Joint against two LRUs and against the best of the static splits run, in one run: ratios < 1 favour
    joint (tokens/s: > 1)."""

    def of(controller: str) -> list[dict[str, Any]]:
        return [c for n, c in cells.items() if n.startswith(f"{workload}/{controller}") and "summary" in c]

    joint, lru, static = of(JOINT), of(INDEPENDENT), of(STATIC)
    if not joint:
        return {}
    j = joint[0]["summary"]
    out: dict[str, Any] = {}
    partners = {"independent_lru": lru[0]["summary"] if lru else None}
    if static:
        partners["best_static_by_tpot_p99"] = min((c["summary"] for c in static), key=lambda s: s["tpot_p99_ms"])
    for name, p in partners.items():
        if p is None:
            continue
        out[f"joint_over_{name}"] = {
            "read_bytes": _ratio(j["read_gib"], p["read_gib"]),
            "tpot_p99": _ratio(j["tpot_p99_ms"], p["tpot_p99_ms"]),
            "ttft_p99": _ratio(j["ttft_p99_ms"], p["ttft_p99_ms"]),
            "tokens_per_s": _ratio(j["tokens_per_s"], p["tokens_per_s"]),
            "slo_attainment": [j["slo_attainment"], p["slo_attainment"]],
        }
    return out


def markdown_table(cells: dict[str, dict[str, Any]]) -> str:
    """The finished cells as a Markdown table (the README's)."""
    head = ("| cell | tokens/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | SLO met | expert / KV miss rate | "
            "read GiB (kernel ÷ I/O) | written GiB | stall s (expert / KV) | expert bytes ÷ MIN same room | "
            "read ÷ FOO | mean KL | cgroup peak GiB |")  # fmt: skip
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, point in cells.items():
        s = point.get("summary")
        if s is None:
            lines.append(f"| {name} | exit {point['exit_status']} |" + " |" * (head.count("|") - 3))
            continue
        lines.append(
            f"| {name} | {s['tokens_per_s']:.2f} | {s['ttft_p50_ms'] / 1e3:.1f} / {s['ttft_p99_ms'] / 1e3:.1f} | "
            f"{s['tpot_p50_ms']:.0f} / {s['tpot_p99_ms']:.0f} | {s['slo_attainment']:.2f} | "
            f"{s['expert_miss_rate']:.2f} / {s['kv_miss_rate']:.3f} | {s['read_gib']:.2f} "
            f"({_num(s['kernel_over_io_read'], 3)}) | {s['io_write_gib']:.2f} | {s['stall_expert_s']:.1f} / "
            f"{s['stall_kv_s']:.1f} | {_num(s['expert_read_over_belady_same_room'])} | "
            f"{_num(s['read_over_foo'])} | {s['mean_kl']:.1e} | {s['cgroup_peak_gib']:.2f} |"
        )
    return "\n".join(lines)


def _num(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fallbackgate.bench.sweep_cells", description=__doc__.splitlines()[4])
    p.add_argument("--model", required=True, help="checkpoint directory (larger than --cgroup-mb)")
    p.add_argument("--json", default="bench-sweep-cells.json")
    p.add_argument("--cgroup-mb", type=int, default=None, help="memory cap of every cell (default 8192; quick 2048)")
    p.add_argument("--ram-budget-mb", type=float, default=None, help="every controller's RAM budget (default 4096)")
    p.add_argument("--cells", nargs="+", default=None, help=f"named cells (default: {' '.join(DEFAULT_CELLS)})")
    p.add_argument("--seed", type=int, default=0, help="the workloads' seed")
    p.add_argument("--num-requests", type=int, default=None, help="requests per workload (default 3; mixed 6)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="answer cap, at most 64 (default 32; quick 8)")
    p.add_argument("--max-model-len", type=int, default=None, help="length limit the workloads scale to (1536)")
    p.add_argument("--ledger", default=None, help="ledger URL (default: a SQLite file next to --json)")
    p.add_argument("--references", default=None, help="reuse the all-in-RAM references of an earlier --json")
    p.add_argument("--quick", action="store_true", help="small defaults for a small checkpoint")
    args = p.parse_args(argv)
    quick = args.quick
    args.cgroup_mb = args.cgroup_mb or (2048 if quick else 8192)
    args.ram_budget_mb = args.ram_budget_mb or (160 if quick else 4096)
    args.num_requests = args.num_requests or (2 if quick else 3)
    args.max_new_tokens = args.max_new_tokens or (8 if quick else 32)
    args.max_model_len = args.max_model_len or (256 if quick else 1536)
    try:
        args.cells = [parse_cell(c) for c in (args.cells or (QUICK_CELLS if quick else DEFAULT_CELLS))]
    except ValueError as exc:
        p.error(str(exc))
    if not 1 <= args.max_new_tokens <= 64 or args.num_requests < 1:
        p.error("--max-new-tokens must be in [1, 64] (the issue's cells) and --num-requests >= 1")
    if args.ram_budget_mb * (1 << 20) >= args.cgroup_mb << 20:
        p.error("--ram-budget-mb must be below --cgroup-mb (the process needs room for dense weights and code)")
    return args


def regime_config(args: argparse.Namespace) -> RegimeConfig:
    """The sweep's configuration these cells run under."""
    workloads = tuple(dict.fromkeys(c.workload for c in args.cells))
    mixed = args.num_requests if args.quick else max(args.num_requests, 6)  # mixed needs requests for its phases
    return RegimeConfig(
        model_dir=str(pathlib.Path(args.model).resolve()), workloads=workloads, seeds=(args.seed,),
        held_out_seed=-1, num_requests=args.num_requests, mixed_requests=mixed,
        max_new_tokens=args.max_new_tokens, max_model_len=args.max_model_len,
    )  # fmt: skip


def reused_references(path: str, config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The references of an earlier run's JSON, when it ran the same requests (ValueError otherwise)."""
    earlier = json.loads(pathlib.Path(path).read_text())
    same = ("model_dir", "seeds", "num_requests", "mixed_requests", "max_new_tokens", "max_model_len", "time_scale",
            "slo_scale", "step_time")  # fmt: skip
    theirs = earlier.get("config", {})
    differ = [k for k in same if json.dumps(theirs.get(k)) != json.dumps(config[k])]
    if differ:
        raise ValueError(f"--references {path}: ran other requests or targets ({', '.join(differ)} differ)")
    return {w: r for w, r in earlier.get("references", {}).items() if r.get("exit_status") == 0}


def run_cells(args: argparse.Namespace, cgroup: Cgroup, results: dict[str, Any]) -> None:
    """Each workload's reference, then its cells; `results` filled as they finish (and written to --json)."""
    cfg = regime_config(args)
    config = dataclasses.asdict(cfg)
    ram = int(args.ram_budget_mb * (1 << 20))
    kept = reused_references(args.references, config) if args.references else {}
    for workload in cfg.workloads:
        if workload in kept:
            ref = kept[workload]
            print(f"[{workload}] reference (SLO targets, demand) from {args.references}", flush=True)
        else:
            print(f"[{workload}] all-in-RAM reference (SLO targets, demand) ...", flush=True)
            ref = run_child("reference", {"config": config, "ledger": results["ledger"], "workload": workload},
                            args.model, None)  # fmt: skip
        results["references"][workload] = ref
        if ref["exit_status"] != 0:
            print(f"[{workload}] reference failed (exit {ref['exit_status']}); its cells are skipped", flush=True)
            continue
        for named in (c for c in args.cells if c.workload == workload):
            cell = {"workload": workload, "seed": args.seed, "is_held_out": False, "controller": named.controller,
                    "kv_share": named.kv_share, "ram_bytes": ram, "ram_frac": round(ram / ref["demand_bytes"], 4),
                    "demand_bytes": ref["demand_bytes"], "kv_demand_bytes": ref["kv_demand_bytes"]}  # fmt: skip
            print(f"[{named.name}] RAM {ram / GIB:.2f} GiB ({cell['ram_frac']:.2f} of demand) in the cgroup ...",
                  flush=True)  # fmt: skip
            spec = {"config": config, "ledger": results["ledger"], "reference": ref, "cell": cell}
            point = run_child("cell", spec, args.model, cgroup)
            if point["exit_status"] == 0:
                point["summary"] = cell_summary(point)
                s = point["summary"]
                print(f"[{named.name}] {s['tokens_per_s']:.2f} tok/s, TPOT p99 {s['tpot_p99_ms']:.0f} ms, read "
                      f"{s['read_gib']:.2f} GiB (kernel/io {s['kernel_over_io_read'] or 0:.3f}), cgroup peak "
                      f"{s['cgroup_peak_gib']:.2f} GiB", flush=True)  # fmt: skip
            results["cells"][named.name] = point
            pathlib.Path(args.json).write_text(json.dumps(results, indent=1, default=str))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (why := cannot_run(args.model)) is not None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    if args.references:
        try:
            reused_references(args.references, dataclasses.asdict(regime_config(args)))
        except (OSError, ValueError) as exc:  # a JSONDecodeError is a ValueError
            print(f"error: {exc}", file=sys.stderr)
            return 2
    ledger = args.ledger or f"sqlite:///{pathlib.Path(args.json).resolve().with_suffix('.ledger.db')}"
    results: dict[str, Any] = {
        "model": args.model, "args": {**vars(args), "cells": [c.name for c in args.cells]},
        "cgroup_bytes": args.cgroup_mb << 20, "ram_budget_bytes": int(args.ram_budget_mb * (1 << 20)),
        "ledger": ledger, "command": "python -m fallbackgate.bench.sweep_cells " + " ".join(sys.argv[1:]),
        "config": dataclasses.asdict(regime_config(args)), "references": {}, "cells": {},
    }  # fmt: skip
    cgroup = Cgroup(f"fallbackgate-cells-{os.getpid()}", args.cgroup_mb << 20)
    try:
        run_cells(args, cgroup, results)
    finally:
        cgroup.remove()
    results["comparisons"] = {w: comparisons(results["cells"], w) for w in results["references"]}
    results["load_average_at_end"] = list(os.getloadavg())
    pathlib.Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    print(markdown_table(results["cells"]))
    print(json.dumps(results["comparisons"], indent=1))
    print(f"wrote {args.json}")
    return 0 if all(c["exit_status"] == 0 for c in results["cells"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

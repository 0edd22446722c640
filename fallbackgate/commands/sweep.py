"""``fallbackgate sweep``: the budget sweep in the RAM-and-disk regime (:mod:`fallbackgate.sweep.regime`).

The probe's workloads from seeds (one held out), RAM budget × KV share for ``static_split``, two independent
LRUs and joint per budget; every run recorded, audited, gated and traced. Writes ``sweep.json`` (every point,
the summary with intervals across seeds, the offline bounds) and heatmap PNGs to ``--out``, and keeps the
traces of the ``--keep-trace`` cells under ``--out``/traces. Exit status: 0 on success, 2 for bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import sys
import tempfile
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from fallbackgate.assembly import Assembly, Overrides, assemble
from fallbackgate.commands.checks import comma_separated
from fallbackgate.engine.errors import EngineError
from fallbackgate.ledger.db import DEFAULT_LEDGER, ENV_VAR, Ledger, LedgerError, open_ledger
from fallbackgate.policy.apply import with_sections
from fallbackgate.policy.schema import EXPERT_ADMISSIONS, STEP_TIMES, AuditMode
from fallbackgate.sweep.anatomy import markdown_table as anatomy_table
from fallbackgate.sweep.anatomy import sweep_anatomy, ttft_table
from fallbackgate.sweep.belady import TraceRecorder
from fallbackgate.sweep.grid import CellBuilder, SweepConfig
from fallbackgate.sweep.inputs import earlier_references, read_class_budgets, read_ram_basis
from fallbackgate.sweep.plot import anatomy_bars, regime_heatmaps
from fallbackgate.sweep.regime import INDEPENDENT, JOINT, STATIC, RegimeConfig, SweepInputError, run_regime
from fallbackgate.sweep.summary import summarise, summary_lines, with_budget_fields
from fallbackgate.tinymoe import CHECKPOINT_DIR
from fallbackgate.workloads.kinds import WorkloadKind

KINDS = tuple(k.value for k in WorkloadKind)


_fracs = comma_separated(float, "fractions", lambda v: 0 < v < 1, "fractions must be in (0, 1)")
_ints = comma_separated(int, "integers", lambda v: v >= 0, "seeds must be integers >= 0")


def _names(choices: tuple[str, ...]) -> Any:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(x.strip() for x in text.split(",") if x.strip())
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown name(s) {unknown}; choose from {list(choices)}")
        return names

    return parse


def add_parser(subparsers: Any) -> None:
    """Register ``sweep``."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "sweep", help="RAM budget × KV share sweep over the probe's workloads (static splits, two LRUs, joint)"
    )
    d = RegimeConfig(model_dir="")
    p.add_argument("--model", default=None, help="checkpoint directory (default: bundled tiny MoE)")
    p.add_argument("--workloads", type=_names(KINDS), default=d.workloads, help="comma-separated workload kinds")
    p.add_argument("--seeds", type=_ints, default=d.seeds, help="workload seeds (comma-separated)")
    p.add_argument("--held-out-seed", type=int, default=d.held_out_seed, help="seed reported apart, never tuned on")
    p.add_argument(
        "--num-requests", type=int, default=d.num_requests, help="requests per workload (mixed: --mixed-requests)"
    )
    p.add_argument("--mixed-requests", type=int, default=d.mixed_requests)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="cap on every answer")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len, help="length limit the workloads scale to")
    p.add_argument("--time-scale", type=float, default=d.time_scale, help="arrival times are multiplied by this")
    p.add_argument(
        "--ram-fracs", type=_fracs, default=d.ram_fracs, help="RAM budgets: fractions of experts + KV demand"
    )
    p.add_argument("--ram-basis-from", type=pathlib.Path, default=None, metavar="SWEEP_JSON",
                   help="fractions of that sweep's demand per workload and seed instead of this one's: the same RAM "
                        "bytes, e.g. for a bf16 copy of its model (python -m fallbackgate.synth.cast)")  # fmt: skip
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="requests decoded together at most")
    p.add_argument("--kv-shares", type=_fracs, default=d.kv_shares, help="static_split's KV shares of the RAM budget")
    p.add_argument("--controllers", type=_names((STATIC, INDEPENDENT, JOINT)), default=d.controllers)
    p.add_argument("--slo-scale", type=float, default=d.slo_scale, help="SLO = this × the all-in-RAM p50 (strict)")
    p.add_argument("--step-time", choices=STEP_TIMES, default=d.step_time,
                   help="what every controller's deadline leaves out: the profile's step time, or the larger of "
                        "it and the run's measured decode compute time (controller.step_time)")  # fmt: skip
    p.add_argument("--expert-admission", choices=EXPERT_ADMISSIONS, default=d.expert_admission,
                   help="joint's in-time expert misses: always the exact copy, or the low-bit copy when colder "
                        "than the expert it would evict (_decode: not while the request prefills; "
                        "controller.expert_admission)")  # fmt: skip
    p.add_argument("--class-budgets", type=pathlib.Path, default=None, metavar="YAML",
                   help="a file of class -> quality-budget fields (strict, best-effort) that replace the sweep's "
                        "own, e.g. to see what a looser budget buys (the SLO targets stay the sweep's)")  # fmt: skip
    p.add_argument("--keep-trace", action="append", default=[], metavar="KEY",
                   help="keep this cell's trace: workload/seed/controller/ram_frac/kv_share (repeatable; "
                        "'all': every cell's)")  # fmt: skip
    lowbit = p.add_mutually_exclusive_group()
    lowbit.add_argument(
        "--lowbit-dir",
        default=None,
        help="memory.lowbit_dir of every cell: low-bit expert "
        "copies prepared once there (default: a directory of this sweep's, removed at its end)",
    )
    lowbit.add_argument("--no-lowbit-copies", action="store_true", help="no prepared low-bit copies: a low-bit "
                        "miss makes its copy from the checkpoint (the sweeps before stop 39)")  # fmt: skip
    p.add_argument("--slo-from", type=pathlib.Path, default=None, metavar="SWEEP_JSON",
                   help="an earlier sweep of the same grid (one part, not a merge): its SLO targets, no reference "
                        "run; to rerun some --controllers against them (bench.joint_ab --controller)")  # fmt: skip
    p.add_argument("--out", default="fallbackgate/sweep_results", help="directory for sweep.json and the PNGs")
    p.add_argument("--ledger", default=None, help=f"ledger URL (default: ${ENV_VAR}, else {DEFAULT_LEDGER})")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> RegimeConfig:
    """The sweep the flags describe (ValueError on bad input)."""
    if min(args.num_requests, args.mixed_requests, args.max_new_tokens, args.max_num_seqs) < 1:
        raise ValueError("--num-requests, --mixed-requests, --max-new-tokens and --max-num-seqs must be >= 1")
    if not 0 < args.time_scale <= 10 or not 1 <= args.slo_scale <= 100:
        raise ValueError("--time-scale must be in (0, 10] and --slo-scale in [1, 100]")
    cfg = RegimeConfig(
        model_dir=args.model or str(CHECKPOINT_DIR), workloads=args.workloads, seeds=args.seeds,
        held_out_seed=args.held_out_seed, num_requests=args.num_requests, mixed_requests=args.mixed_requests,
        max_new_tokens=args.max_new_tokens, max_model_len=args.max_model_len, time_scale=args.time_scale,
        ram_fracs=args.ram_fracs, kv_shares=args.kv_shares, controllers=args.controllers, slo_scale=args.slo_scale,
        step_time=args.step_time, expert_admission=args.expert_admission,
        class_budgets=read_class_budgets(args.class_budgets), lowbit_dir=args.lowbit_dir,
        keep_traces=tuple(args.keep_trace), trace_out=str(pathlib.Path(args.out) / "traces"),
        max_num_seqs=args.max_num_seqs,
    )  # fmt: skip
    if args.ram_basis_from is not None:
        cfg = dataclasses.replace(cfg, ram_basis=read_ram_basis(cfg, args.ram_basis_from))
    return cfg if args.slo_from is None else dataclasses.replace(cfg, slo_from=earlier_references(cfg, args.slo_from))


def cell_builder(cfg: SweepConfig) -> CellBuilder:
    """The sweep's engines from the one assembly: ``cfg.policy`` in enforce mode with the cell's controller,
    device budget (exact bytes; None: unlimited) and split, the controller wrapped to record its trace."""
    base = with_sections(
        cfg.policy, {"audit": {"mode": AuditMode.ENFORCE.value, "sample_rate": cfg.audit_rate}}, cfg.model_dir
    )

    def build(kind: str, device_budget: int | None, split: float, calibration: Ledger | None) -> Assembly:
        policy = with_sections(base, {"controller": {"kind": kind}, "memory": {"device_budget_mb": None}})
        overrides = Overrides(
            seed=cfg.workload.seed,
            device_budget_bytes=device_budget,
            expert_fraction=split,
            is_equivalent_allowed=cfg.is_equivalent_allowed,
            wrap_controller=TraceRecorder,
        )
        return assemble(policy, overrides, policy_name=cfg.policy_name, calibration=calibration)

    return build


def write_outputs(result: dict[str, Any], out: str | pathlib.Path, is_plotted: bool = True) -> list[pathlib.Path]:
    """``sweep.json`` and (``is_plotted``) the heatmaps under ``out``."""
    folder = pathlib.Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    json_path = folder / "sweep.json"
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    return [json_path, *(regime_heatmaps(result["points"], folder) if is_plotted else [])]


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fallbackgate sweep``."""
    try:
        cfg = config_from_args(args)
        ledger = open_ledger(args.ledger)
    except (LedgerError, ValueError) as exc:
        print(f"fallbackgate sweep: error: {exc}", file=sys.stderr)
        return 2
    scratch = None
    if cfg.lowbit_dir is None and not args.no_lowbit_copies:
        scratch = tempfile.mkdtemp(prefix="fg-sweep-lowbit-")
        cfg = dataclasses.replace(cfg, lowbit_dir=scratch)
    try:
        result = run_regime(cfg, ledger)
        anatomy = _anatomy(result["points"], ledger, cfg.held_out_seed)
    except (EngineError, SweepInputError) as exc:
        print(f"fallbackgate sweep: error: {exc}", file=sys.stderr)
        return 2
    finally:
        ledger.close()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    result["command"] = "fallbackgate sweep " + " ".join(sys.argv[2:])
    result["load_average_at_end"] = list(os.getloadavg())
    write_outputs(result, args.out, is_plotted=False)  # the raw points first
    result["points"] = with_budget_fields(result["points"])
    result["summary"] = summarise(result["points"], cfg.held_out_seed)
    if anatomy is not None:
        result["anatomy"] = anatomy
    paths = write_outputs(result, args.out)
    (pathlib.Path(args.out) / "sweep.partial.json").unlink(missing_ok=True)  # progress of a run cut short only
    print("\n".join(summary_lines(result["summary"])))
    if anatomy is not None:
        paths.append(anatomy_bars(anatomy, pathlib.Path(args.out) / "anatomy.png"))
        print(anatomy_table(anatomy) + "\n" + ttft_table(anatomy))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _anatomy(points: list[dict[str, Any]], ledger: Ledger, held_out: int) -> dict[str, Any] | None:
    """The runs' TPOT anatomy read back from the ledger they were just recorded in; None, with a warning, where
    the ledger cannot give it (the sweep's results are written either way)."""
    try:
        return sweep_anatomy(points, ledger, held_out)
    except (LedgerError, SQLAlchemyError) as exc:
        print(f"fallbackgate sweep: warning: no TPOT anatomy: {exc}", file=sys.stderr)
        return None

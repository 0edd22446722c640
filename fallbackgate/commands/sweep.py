"""``fallbackgate sweep``: every controller over an expert × KV budget grid on a mixed workload.

Writes ``sweep.json`` (all points, the dashboard's Budget sweep format) and ``sweep.png`` (heatmaps) to
``--out``, records one ledger run per cell × controller, and prints the headline comparisons.
Exit status: 0 on success, 2 for bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
from typing import Any

from fallbackgate.assembly import Assembly, Overrides, assemble
from fallbackgate.engine.errors import EngineError
from fallbackgate.ledger.db import DEFAULT_LEDGER, ENV_VAR, Ledger, LedgerError, open_ledger
from fallbackgate.policy import PolicyError, load_policy
from fallbackgate.policy.apply import with_sections
from fallbackgate.policy.schema import AuditMode, ControllerKind
from fallbackgate.sweep.belady import TraceRecorder
from fallbackgate.sweep.grid import CONTROLLERS, CellBuilder, SweepConfig, run_sweep
from fallbackgate.sweep.plot import heatmaps
from fallbackgate.sweep.workload import WorkloadSpec, default_policy
from fallbackgate.tinymoe import CHECKPOINT_DIR


def _fracs(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions, got {text!r}") from None
    if not values or any(not 0 < v <= 4 for v in values):
        raise argparse.ArgumentTypeError(f"fractions must be in (0, 4], got {text!r}")
    return values


def _controllers(text: str) -> tuple[str, ...]:
    kinds = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [k for k in kinds if k not in CONTROLLERS]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"unknown controller(s) {unknown}; choose from {list(CONTROLLERS)}")
    return kinds


def add_parser(subparsers: Any) -> None:
    """Register ``sweep``."""
    p: argparse.ArgumentParser = subparsers.add_parser("sweep", help="expert × KV budget sweep over controllers")
    p.add_argument("--model", default=None, help="checkpoint directory (default: bundled tiny MoE)")
    p.add_argument("--policy", default=None, help="policy YAML with classes 'strict' and 'best-effort'")
    p.add_argument("--expert-fracs", type=_fracs, default=(0.2, 0.4, 0.6, 0.8), help="fractions of all expert bytes")
    p.add_argument("--kv-fracs", type=_fracs, default=(0.5,), help="fractions of the workload's peak KV bytes")
    p.add_argument("--controllers", type=_controllers, default=CONTROLLERS, help="comma-separated controllers")
    p.add_argument(
        "--static-fracs",
        type=_fracs,
        default=(0.2, 0.5, 0.8, 0.9),
        help="static splits tried at the headline budget (expert share of the device budget)",
    )
    p.add_argument("--headline-expert-frac", type=float, default=0.4, help="cell of the headline comparisons")
    p.add_argument("--chats", type=int, default=6, help="short chat requests")
    p.add_argument("--long", type=int, default=2, help="long-context requests")
    p.add_argument("--long-tokens", type=int, default=192, help="prompt tokens of a long-context request")
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens generated per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--audit-rate", type=float, default=1.0, help="fraction of requests audited")
    p.add_argument("--out", default="fallbackgate/sweep_results", help="directory for sweep.json and sweep.png")
    p.add_argument("--ledger", default=None, help=f"ledger URL (default: ${ENV_VAR}, else {DEFAULT_LEDGER})")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> SweepConfig:
    """The sweep configuration the flags describe (raises PolicyError / ValueError on bad input)."""
    policy = load_policy(args.policy) if args.policy else default_policy()
    missing = {"strict", "best-effort"} - set(policy.classes)
    if missing:
        raise ValueError(f"the sweep's workload needs policy classes {sorted(missing)}")
    if not 0 < args.audit_rate <= 1:
        raise ValueError(f"--audit-rate must be in (0, 1], got {args.audit_rate}")
    workload = WorkloadSpec(
        seed=args.seed,
        num_chats=args.chats,
        num_long=args.long,
        long_tokens=args.long_tokens,
        chat_new_tokens=args.max_new_tokens,
        long_new_tokens=args.max_new_tokens,
    )
    return SweepConfig(
        model_dir=args.model or str(CHECKPOINT_DIR),
        policy=policy,
        policy_name=pathlib.Path(args.policy).stem if args.policy else "sweep",
        expert_fracs=args.expert_fracs,
        kv_fracs=args.kv_fracs,
        controllers=args.controllers,
        workload=workload,
        audit_rate=args.audit_rate,
        headline_expert_frac=args.headline_expert_frac,
        static_fracs=args.static_fracs if ControllerKind.STATIC_SPLIT.value in args.controllers else (),
        progress=not args.quiet,
    )


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


def write_outputs(result: dict[str, Any], out: str | pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """``sweep.json`` and ``sweep.png`` under ``out``."""
    folder = pathlib.Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    json_path = folder / "sweep.json"
    json_path.write_text(json.dumps(result, indent=1, sort_keys=False) + "\n")
    return json_path, heatmaps(result["points"], folder / "sweep.png")


def print_summary(result: dict[str, Any]) -> None:
    """One line per point, then the headline."""
    print(
        f"{'controller':16s} {'exp':>5s} {'kv':>5s} {'TPOT ms':>8s} {'p99':>8s} {'TTFT ms':>8s} {'SLO':>5s} "
        f"{'mTPOT ms':>8s} {'exactMiB':>8s} {'Belady':>8s} {'meanKL':>8s} gate   (measured; mTPOT: modeled what-if)"
    )
    for p in result["points"]:
        m = p["metrics"]
        print(
            f"{p['controller']:16s} {p['expert_frac']:5.2f} {p['kv_frac']:5.2f} {m['tpot_mean_ms']:8.3f} "
            f"{m['tpot_p99_ms']:8.3f} {m['ttft_mean_ms']:8.3f} {m['slo_attainment']:5.2f} "
            f"{m['modeled_tpot_mean_ms']:8.3f} "
            f"{m['expert_exact_bytes'] / 2**20:8.2f} {m['belady_expert_bytes'] / 2**20:8.2f} {m['mean_kl']:8.2g} "
            f"{'pass' if m['gate_passed'] else 'FAIL'}"
        )
    print("headline:", json.dumps(result["headline"], indent=1))


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fallbackgate sweep``."""
    try:
        cfg = config_from_args(args)
        ledger = open_ledger(args.ledger)
    except (PolicyError, LedgerError, ValueError) as exc:
        print(f"fallbackgate sweep: error: {exc}", file=sys.stderr)
        return 2
    try:
        result = run_sweep(cfg, ledger, cell_builder(cfg))
    except EngineError as exc:
        print(f"fallbackgate sweep: error: {exc}", file=sys.stderr)
        return 2
    finally:
        ledger.close()
    result["command"] = " ".join(sys.argv[1:]) or "sweep"
    result["config"] = {
        k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("policy", "policy_name", "workload")
    }
    json_path, png_path = write_outputs(result, args.out)
    print_summary(result)
    print(f"wrote {json_path} and {png_path}; dashboard: FALLBACKGATE_SWEEP_JSON={json_path} fallbackgate dashboard")
    return 0

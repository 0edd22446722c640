"""``fallbackgate run``: serve prompts through the engine, record every step, audit, and judge.

Exit status: 0 when the gate passes, 1 when it fails, 2 for bad input (model, prompts, budget, ledger).
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
from typing import Any

from fallbackgate.assembly import Assembly, Overrides, assemble, no_policy
from fallbackgate.batch.demo import DEMO_POLICY, is_demo_run, print_demo_budget, print_demo_recap
from fallbackgate.batch.prompts import PromptsFileError, PromptSpec, check_classes, load_prompts
from fallbackgate.batch.report import print_report, to_json, write_json
from fallbackgate.batch.session import RunSettings, run_prompts
from fallbackgate.batch.summary import print_prefix_reuse, print_slips, print_slo_misses, print_summary
from fallbackgate.commands.checks import add_kv_flags, add_trace_flag, check_output_path, check_trace_flag
from fallbackgate.controllers.exact_lru import FORCEABLE_TAGS
from fallbackgate.engine.config import PREEMPT_MODES
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.errors import EngineError
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.ledger.db import DEFAULT_LEDGER, ENV_VAR, Ledger, LedgerError, open_ledger
from fallbackgate.ledger.writer import LedgerWriter
from fallbackgate.policy import CONTROLLER_KINDS, Policy
from fallbackgate.policy.apply import policy_from_args
from fallbackgate.policy.schema import AUDIT_MODES, ControllerKind
from fallbackgate.profiling import PROFILE_NAMES


def add_parser(subparsers: Any) -> None:
    """Register ``run``."""
    p: argparse.ArgumentParser = subparsers.add_parser("run", help="serve prompts, record, audit and gate")
    p.add_argument("--policy", default=None, help="policy YAML; flags given on the command line override it")
    p.add_argument("--model", default=None, help="checkpoint directory (default: bundled tiny MoE)")
    p.add_argument("--prompts", default=None, help="JSONL: prompt (required), id, class, max_new_tokens")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 = seeded sampling")
    _add_memory_flags(p)
    _add_audit_flags(p)
    p.set_defaults(func=run)


def _add_memory_flags(p: argparse.ArgumentParser) -> None:
    """Budgets, tiers, KV layout, the hardware profile and the read-ahead threads."""
    p.add_argument(
        "--device-budget-mb",
        type=float,
        default=None,
        help="every device byte: expert slots, KV blocks, staged and gathered KV, dequantized low-bit experts. "
        "Without a GPU this is the one RAM budget (experts, low-bit copies, KV blocks, scratch; the disk holds "
        "the checkpoint and the KV spill); without it, the memory limit (cgroup or physical RAM) minus the "
        "dense weights and a margin",
    )
    p.add_argument(
        "--host-budget-mb",
        type=float,
        default=None,
        help="GPU only: host memory for cached expert copies, low-bit copies and KV copies, in true bytes; "
        "experts not cached are read from the checkpoint's own files, KV beyond it goes to --spill-dir. "
        "Without a GPU there is no host tier (only 0 is accepted)",
    )
    p.add_argument("--spill-dir", default=None, help="KV disk tier directory (default: a temporary directory)")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="compute dtype (default: the checkpoint's own)",
    )
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default 16)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="requests decoded together at most (default 8)")
    p.add_argument("--preempt", choices=PREEMPT_MODES, default=None, help="what preemption does to KV")
    add_kv_flags(p)
    p.add_argument(
        "--profile",
        choices=PROFILE_NAMES,
        default=None,
        help="hardware profile the controller predicts with: measured (default: this machine, `fallbackgate "
        "profile`) or a shipped what-if (cpu-box, pcie4-gpu-nvme)",
    )
    p.add_argument(
        "--io-threads",
        type=int,
        choices=range(0, 9),
        default=None,
        metavar="N",
        help="threads reading experts from disk ahead of use, 0-8 (default: 2, or 0 on a CPU-only machine with "
        "2 cores, where they measured slower; 0: every read on the compute thread)",
    )


def _add_audit_flags(p: argparse.ArgumentParser) -> None:
    """The controller and forced tags, the ledger, the audit and what the run writes."""
    p.add_argument("--controller", choices=CONTROLLER_KINDS, default=None, help="controller (overrides the policy)")
    p.add_argument("--mode", choices=AUDIT_MODES, default=None, help="audit mode (overrides the policy)")
    p.add_argument(
        "--force",
        action="append",
        default=[],
        choices=sorted(t.value for t in FORCEABLE_TAGS),
        help="force a fallback tag on (repeatable), for testing; cpu_execute is not offered where the device is "
        "the CPU (RAM is the only fast tier: no host copy to compute from)",
    )
    p.add_argument("--ledger", default=None, help=f"ledger URL (default: ${ENV_VAR}, else {DEFAULT_LEDGER})")
    p.add_argument("--no-ledger", action="store_true", help="record nothing (no audit, no gate)")
    p.add_argument("--audit-rate", type=float, default=None, help="fraction of requests audited (default 1)")
    p.add_argument(
        "--audit",
        choices=("inline", "deferred"),
        default="inline",
        help="inline (default): audit and judge before exiting; deferred: leave the sample's served logits and "
        "audit tasks in the ledger for `fallbackgate audit` workers and exit after serving",
    )
    p.add_argument("--json", default=None, help="write the run's results as JSON to this path")
    add_trace_flag(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")


MAX_NEW_TOKENS = 1 << 20


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad flags before anything is built or written; the message names the flag and value."""
    if not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        raise ValueError(f"--max-new-tokens must be 1..{MAX_NEW_TOKENS}, got {args.max_new_tokens}")
    if not (math.isfinite(args.temperature) and 0.0 <= args.temperature <= 100.0):
        raise ValueError(f"--temperature must be a number in [0, 100], got {args.temperature}")
    if not 0 <= args.seed < 1 << 63:
        raise ValueError(f"--seed must be 0..2^63-1, got {args.seed}")
    for flag in ("device_budget_mb", "host_budget_mb", "audit_rate"):
        value = getattr(args, flag)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"--{flag.replace('_', '-')} must be a finite number >= 0, got {value}")
    for flag in ("block_size", "max_num_seqs"):
        value = getattr(args, flag)
        if value is not None and not 1 <= value <= 1 << 16:
            raise ValueError(f"--{flag.replace('_', '-')} must be 1..65536, got {value}")
    if args.max_model_len is not None and not 1 <= args.max_model_len <= 1 << 24:
        raise ValueError(f"--max-model-len must be 1..16777216, got {args.max_model_len}")
    if args.block_size is not None and args.block_size & (args.block_size - 1):
        raise ValueError(f"--block-size: block_size must be a power of two, got {args.block_size}")
    if args.audit_rate is not None and not 0.0 < args.audit_rate <= 1.0:
        raise ValueError(f"--audit-rate must be in (0, 1], got {args.audit_rate}")
    if args.json:
        check_output_path(args.json, "--json")
    check_trace_flag(args)


def run_inputs(args: argparse.Namespace) -> tuple[Policy, Overrides, str | None]:
    """The policy (``--policy`` or :func:`no_policy`, flags applied), the overrides and the policy file's stem."""
    policy = policy_from_args(args, no_policy())
    if args.force and policy.controller.kind != ControllerKind.EXACT_LRU:
        print(
            f"fallbackgate run: warning: --force {' '.join(args.force)} is ignored: the policy's controller is "
            f"{policy.controller.kind}; forced tags act only with exact_lru",
            file=sys.stderr,
        )
        args.force = []
    overrides = Overrides(
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        temperature=args.temperature,
        dtype=args.dtype,
        num_io_threads=args.io_threads,
        force=tuple(args.force),
        trace_dir=args.trace,
    )
    return policy, overrides, pathlib.Path(args.policy).stem if args.policy is not None else None


def _setup(args: argparse.Namespace) -> tuple[list[PromptSpec], Assembly, LedgerWriter | None]:
    """Prompts, the assembled engine and the ledger writer (None with --no-ledger)."""
    check_args(args)
    args.is_demo = is_demo_run(args)
    if args.is_demo:  # the embedded default: the bundled model under memory pressure
        args.policy = str(DEMO_POLICY)
    specs = load_prompts(args.prompts)
    policy, overrides, name = run_inputs(args)
    if name is not None:
        specs = check_classes(specs, policy.classes, policy.default_class)
    is_joint = policy.controller.kind == ControllerKind.JOINT  # the one controller that predicts with calibrated costs
    costs = _existing_ledger(policy.ledger.url) if is_joint and not args.no_ledger else None  # read only
    try:
        built = assemble(policy, overrides, policy_name=name, calibration=costs)
    finally:
        if costs is not None:
            costs.close()
    return specs, built, _open_after_checks(built.engine, specs, built.settings, policy.ledger.url, args)


def _existing_ledger(url: str | None) -> Ledger | None:
    """The ledger at `url` opened read-only when it exists with the current schema (for the policy's
    calibrated costs); None otherwise (a new ledger holds no calibration)."""
    try:
        return open_ledger(url, read_only=True)
    except LedgerError as exc:
        if "old schema revision" in str(exc):  # an existing ledger from an older fallbackgate: upgrade it now
            return open_ledger(url)
        return None


def _open_after_checks(
    engine: Engine, specs: list[PromptSpec], settings: RunSettings, url: str | None, args: argparse.Namespace
) -> LedgerWriter | None:
    """Check every request against the model, then open the ledger (nothing is written before)."""
    try:
        _check_requests(engine, specs, settings)
        return None if args.no_ledger else LedgerWriter(open_ledger(url))
    except BaseException:
        engine.close()
        raise


def _check_requests(engine: Engine, specs: list[PromptSpec], settings: RunSettings) -> None:
    """Every prompt fits the model (length, tokens) before the run row is written."""
    for spec in specs:
        params = SamplingParams(max_new_tokens=spec.max_new_tokens or settings.max_new_tokens)
        engine.check_request(engine.tokenizer.encode(spec.prompt), params, spec.request_id)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fallbackgate run``."""
    try:
        specs, built, writer = _setup(args)
    except (PromptsFileError, EngineError, LedgerError, ValueError) as exc:
        print(f"fallbackgate run: error: {exc}", file=sys.stderr)
        return 2
    try:
        return _serve(args, specs, built, writer)
    except EngineError as exc:  # e.g. a full spill directory: the run is marked failed
        print(f"fallbackgate run: error: {exc}", file=sys.stderr)
        return 2
    except LedgerError as exc:  # e.g. the ledger's disk filled up: marked failed where the database still allows
        print(f"fallbackgate run: error: {exc}", file=sys.stderr)
        return 1
    finally:
        built.engine.close()


def _serve(args: argparse.Namespace, specs: list[PromptSpec], built: Assembly, writer: LedgerWriter | None) -> int:
    engine, slos = built.engine, built.classes.slos
    is_demo = getattr(args, "is_demo", False)
    if writer is None:
        outcome = run_prompts(engine, specs, built.settings, None, not args.quiet)
        print_report(outcome, sys.stdout, slos)
        if is_demo:
            print_demo_budget(engine, specs, args.max_new_tokens, sys.stdout)
        print_slips(engine.controller, sys.stdout)
        print_prefix_reuse(outcome.memory, sys.stdout)
        print_slo_misses(outcome, slos, sys.stdout)
        if args.json:
            write_json(args.json, to_json(outcome, None, slos=slos))
        return 0
    recorder = built.recorder(writer, note=f"force={args.force}")
    outcome = recorder.serve(specs, built.settings, not args.quiet)
    print_report(outcome, sys.stdout, slos)
    print_slips(engine.controller, sys.stdout)
    print_prefix_reuse(outcome.memory, sys.stdout)
    verdict = recorder.finish(outcome, is_deferred=args.audit == "deferred")
    if verdict is None:
        print(
            f"\nrun {recorder.run_id}: audit deferred: {recorder.num_deferred} request(s) queued in the ledger; "
            f"judge them with `fallbackgate audit --ledger {writer.ledger.display_url}`"
        )
    else:
        print_summary(outcome, verdict, recorder.num_audited, slos, writer.ledger.display_url, sys.stdout)
        if is_demo:
            print_demo_budget(engine, specs, args.max_new_tokens, sys.stdout)
            print_demo_recap(outcome, verdict, built.classes.budgets, sys.stdout)
    if args.json:
        write_json(args.json, to_json(outcome, recorder.run_id, slos=slos))
    return 0 if verdict is None or verdict.passed else 1

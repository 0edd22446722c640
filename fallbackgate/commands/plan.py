"""``fallbackgate plan --model DIR --context N --concurrency B [--device-budget-mb X] [--host-budget-mb Y]
[--policy FILE] [--profile P] [--device auto|cpu|cuda] [--json FILE]``: will it run, and how, before loading
any weight.

Reads config.json and the safetensors headers only. Prints whether the model fits the device budget, the
split between KV blocks and expert slots, the expected expert hit rate, predicted (modeled, from the
hardware profile) TTFT and TPOT, and for each class of the policy whether its TPOT SLO is met exactly or
which fallback it would need, with the predicted quality cost. Where the device is the CPU (``--device
auto`` without CUDA) the plan has the engine's two CPU tiers, RAM and the disk, and says so: no host tier, no
cpu_execute.

Exit status: 0 when it fits, 1 when it does not, 2 for bad arguments, model or policy.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

from fallbackgate.engine.config import MIB, TierLayout, tier_layout
from fallbackgate.engine.errors import EngineError
from fallbackgate.engine.model.build import resolve_device
from fallbackgate.ledger.db import LedgerError, open_ledger
from fallbackgate.planning.history import routing_exponent
from fallbackgate.planning.plan import Plan, Workload, make_plan
from fallbackgate.planning.shape import model_shape
from fallbackgate.policy.apply import class_budgets, class_slos
from fallbackgate.policy.loader import load_policy
from fallbackgate.profiling import MEASURED, PROFILE_NAMES
from fallbackgate.profiling.store import resolve_profile
from fallbackgate.tinymoe import CHECKPOINT_DIR


def add_parser(subparsers: Any) -> None:
    """Register ``plan``."""
    p: argparse.ArgumentParser = subparsers.add_parser("plan", help="predict fit, speed and fallbacks before running")
    p.add_argument("--model", default=str(CHECKPOINT_DIR), help="checkpoint directory (default: bundled)")
    p.add_argument("--context", type=int, required=True, help="tokens per request (prompt + output)")
    p.add_argument("--concurrency", type=int, required=True, help="requests decoded together")
    p.add_argument("--prompt-tokens", type=int, default=None, help="of the context, the prompt (default: half)")
    p.add_argument("--device-budget-mb", type=float, default=None, help="default: everything fits")
    p.add_argument("--host-budget-mb", type=float, default=None, help="default: every expert cached in host memory")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--policy", default=None, help="policy YAML: its classes' SLOs and budgets are planned for")
    p.add_argument("--profile", choices=PROFILE_NAMES, default=MEASURED, help="hardware profile (default: measured)")
    p.add_argument("--ledger", default=None, help="fit the model's routing concentration from its recorded runs here")
    tiers = "the engine's device, for its tiers: cpu has RAM and the disk (auto: cuda when available)"
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help=tiers)
    p.add_argument("--json", default=None, help="also write the plan as JSON to this path")
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    if args.prompt_tokens is not None and not 1 <= args.prompt_tokens <= args.context:
        raise ValueError(f"--prompt-tokens must be 1..--context ({args.context}), got {args.prompt_tokens}")
    for name in ("context", "concurrency", "block_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("device_budget_mb", "host_budget_mb"):
        value = getattr(args, name)
        if value is not None and not 0 <= value < 1e9:
            raise ValueError(f"--{name.replace('_', '-')} must be a number of MB >= 0, got {value}")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fallbackgate plan``."""
    try:
        _check(args)
        shape = model_shape(args.model)
        policy = load_policy(args.policy) if args.policy else None
        profile = resolve_profile(args.profile)
    except (EngineError, ValueError) as exc:
        print(f"fallbackgate plan: error: {exc}", file=sys.stderr)
        return 2
    to_bytes = lambda mb: None if mb is None else int(mb * MIB)  # noqa: E731
    try:
        workload = Workload(
            args.context,
            args.concurrency,
            to_bytes(args.device_budget_mb),
            to_bytes(args.host_budget_mb),
            args.block_size,
            (policy.controller.expert_lowbit_bits or 8) if policy else 8,
            layout=tier_layout(resolve_device(args.device), is_emulated_device_tier=False),
        )
    except ValueError as exc:
        print(f"fallbackgate plan: error: {exc}", file=sys.stderr)
        return 2
    classes = None
    if policy is not None:
        budgets, slos = class_budgets(policy), class_slos(policy)
        classes = {name: {"budget": budgets[name], "slo": slos[name]} for name in policy.classes}
    if args.ledger:
        try:
            with open_ledger(args.ledger, read_only=True) as ledger:
                alpha = routing_exponent(ledger, shape)
        except LedgerError as exc:
            print(f"fallbackgate plan: error: {exc}", file=sys.stderr)
            return 2
        workload.routing_exponent = alpha if alpha is not None else 1.0
        print(
            f"routing: exponent {workload.routing_exponent:.2f} "
            + ("from recorded runs" if alpha else "(uniform: no recorded run)")
        )
    plan = make_plan(shape, profile, workload, classes)
    _print(plan, shape.name, profile.name)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(plan.as_dict(), indent=2) + "\n")
    return 0 if plan.fits else 1


def _print(plan: Plan, model: str, profile: str) -> None:
    print(f"model {model}: {'fits' if plan.fits else 'DOES NOT FIT'} ({plan.reason})")
    if plan.tier_note:
        print(plan.tier_note)
    where = "in RAM" if plan.tier_layout == TierLayout.RAM_DISK.value else "on device"
    print(
        f"memory: KV {plan.kv_bytes / MIB:.1f} MiB, experts {plan.expert_slot_bytes / MIB:.1f} MiB = "
        f"{plan.num_expert_slots} of {plan.num_experts_total} experts {where}; misses come from {plan.home}"
    )
    print(
        f"predicted (modeled, profile {profile}): expert hit rate {plan.hit_rate:.2f}, TTFT {plan.ttft_ms:.1f} ms, "
        f"TPOT {plan.tpot_ms:.1f} ms, {plan.tokens_per_s:.1f} tokens/s"
    )
    for c in plan.classes:
        if c.is_met_exactly:
            print(f"  class {c.name}: TPOT SLO {c.tpot_slo_ms} ms met exactly")
        elif c.is_met:
            print(
                f"  class {c.name}: needs {c.fallback} on misses for TPOT {c.predicted_tpot_ms:.1f} ms "
                f"<= {c.tpot_slo_ms} ms; "
                f"predicted cost {c.predicted_kl_per_token:.3g} nats/token (budget mean KL {c.budget_mean_kl})"
            )
        elif c.fallback is None:
            print(f"  class {c.name}: TPOT SLO {c.tpot_slo_ms} ms not met, and no allowed fallback is offered here")
        else:
            print(
                f"  class {c.name}: TPOT SLO {c.tpot_slo_ms} ms not met by any allowed fallback "
                f"(best {c.fallback}: {c.predicted_tpot_ms:.1f} ms)"
            )

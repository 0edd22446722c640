"""Turn a policy (plus command-line overrides) into run settings, an engine and a controller."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import Counter
from typing import Any, TextIO

from pydantic import ValidationError
from sqlalchemy import make_url
from sqlalchemy.exc import ArgumentError

from fallbackgate.batch.prompts import PromptsFileError, PromptSpec
from fallbackgate.batch.session import RunSettings
from fallbackgate.controllers import ControllerKind, JointController, make_controller
from fallbackgate.controllers.cost import CostModel, load_calibration
from fallbackgate.engine.controller import Controller
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.errors import CheckpointError
from fallbackgate.ledger.db import Ledger
from fallbackgate.policy.loader import PolicyError, format_errors, hardware_profile, load_policy
from fallbackgate.policy.schema import Policy
from fallbackgate.tinymoe import CHECKPOINT_DIR

# command-line flag (argparse dest) -> (policy section, field); a flag given on the command line wins
OVERRIDES: dict[str, tuple[str, str]] = {
    "device_budget_mb": ("memory", "device_budget_mb"),
    "host_budget_mb": ("memory", "host_budget_mb"),
    "spill_dir": ("memory", "spill_dir"),
    "block_size": ("memory", "block_size"),
    "max_num_seqs": ("memory", "max_num_seqs"),
    "preempt": ("memory", "preempt_mode"),
    "profile": ("hardware", "profile"),
    "audit_rate": ("audit", "sample_rate"),
    "mode": ("audit", "mode"),
    "ledger": ("ledger", "url"),
    "controller": ("controller", "kind"),
}


def merge_args(policy: Policy, args: argparse.Namespace) -> Policy:
    """A copy of `policy` with every explicitly given flag applied (flags left at None keep the policy's value)."""
    updates: dict[str, dict[str, Any]] = {}
    for dest, (section, field) in OVERRIDES.items():
        value = getattr(args, dest, None)
        if value is not None:
            updates.setdefault(section, {})[field] = value
    data = policy.model_dump()
    for section, fields in updates.items():
        data[section].update(fields)
    if getattr(args, "model", None) is not None:
        data["model"] = args.model
    return Policy.model_validate(data)


def run_settings(policy: Policy, args: argparse.Namespace) -> RunSettings:
    """Run settings from a merged policy and the run-only flags (tokens, seed, temperature)."""
    mem = policy.memory
    return RunSettings(
        policy.model or str(CHECKPOINT_DIR),
        args.max_new_tokens,
        args.seed,
        args.temperature,
        mem.device_budget_mb,
        mem.host_budget_mb,
        mem.spill_dir,
        mem.block_size,
        mem.max_num_seqs,
        policy.hardware.profile,
        mem.preempt_mode,
        dtype=getattr(args, "dtype", None),
        is_stacked_when_fits=not getattr(args, "force", None),
        num_io_threads=getattr(args, "io_threads", None),
    )


def check_classes(policy: Policy, specs: list[PromptSpec]) -> list[PromptSpec]:
    """Requests name their class in the prompts file; "default" maps to the policy's default class."""
    out = []
    for spec in specs:
        name = policy.default_class if spec.request_class == "default" else spec.request_class
        if name not in policy.classes:
            raise PromptsFileError(
                f"request {spec.request_id!r}: class {spec.request_class!r} is not in the policy "
                f"(classes: {sorted(policy.classes)})"
            )
        out.append(dataclasses.replace(spec, request_class=name))
    return out


def build_policy_engine(
    policy: Policy, settings: RunSettings, ledger: Ledger | None, force: list[str] = ()
) -> tuple[Engine, Controller]:
    """The engine with the policy's hardware profile and controller (calibrated costs from the ledger)."""
    kind = ControllerKind(policy.controller.kind)
    if force and kind is ControllerKind.EXACT_LRU:
        from fallbackgate.controllers.exact_lru import ExactLRUController

        controller: Controller = ExactLRUController(force, kv_quant_bits=policy.controller.kv_quant_bits)
    else:
        bits = policy.controller.expert_lowbit_bits or 8
        cost = load_calibration(ledger, bits) if ledger is not None else CostModel(lowbit_bits=bits)
        controller = make_controller(kind, policy, cost_model=cost)
    config = dataclasses.replace(
        settings.engine_config(),
        profile=hardware_profile(policy),
        expert_lowbit_bits=policy.controller.expert_lowbit_bits,
    )
    engine = Engine(config, controller)
    if engine.tokenizer is None:
        raise CheckpointError(f"{settings.model_dir}: no tokenizer files next to the weights; text prompts need one")
    if isinstance(controller, JointController):
        controller.top_k = int(getattr(engine.model_config, "num_experts_per_tok", 1) or 1)
    engine.is_observe = policy.audit.mode == "observe"
    return engine, controller


def policy_from_args(args: argparse.Namespace) -> Policy:
    """Load ``args.policy`` and apply the flags given on the command line (errors name the field)."""
    policy = load_policy(args.policy)
    try:
        return merge_args(policy, args)
    except ValidationError as exc:
        raise PolicyError(f"{args.policy} with command-line overrides", format_errors(exc)) from None


def policy_record(policy: Policy) -> str:
    """The effective policy as JSON for the run row, with any password in the ledger URL hidden."""
    data = policy.model_dump(mode="json")
    url = data.get("ledger", {}).get("url")
    if url:
        try:
            data["ledger"]["url"] = make_url(url).render_as_string(hide_password=True)
        except ArgumentError:
            data["ledger"]["url"] = "(unparsable URL)"
    return json.dumps(data, sort_keys=True)


def class_budgets(policy: Policy) -> dict[str, dict[str, Any]]:
    """request class -> quality budget, in the form the gate and the ledger take."""
    return {name: cls.budget.as_gate_dict() for name, cls in policy.classes.items()}


def class_slos(policy: Policy) -> dict[str, dict[str, Any]]:
    """request class -> SLO targets (milliseconds), as recorded on the ledger's request rows."""
    return {name: cls.slo.model_dump() for name, cls in policy.classes.items()}


def print_slips(controller: Controller, out: TextIO) -> None:
    """One line summarising the SLO slips a controller recorded (nothing when there were none)."""
    slips = getattr(controller, "slips", [])
    if slips:
        reasons = Counter(s.reason for s in slips)
        print(
            f"\nSLO slips (deadline missed to keep a quality budget or class): {len(slips)} {dict(reasons)}", file=out
        )
    arbitrations = getattr(controller, "arbitrations", [])
    if arbitrations:
        choices = Counter(a.choice.value for a in arbitrations)
        print(f"late exact KV copies arbitrated against expert loads: {len(arbitrations)} {dict(choices)}", file=out)

"""A policy with overrides applied (command-line flags, sections), and the parts of it a run records."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pydantic import ValidationError
from sqlalchemy import make_url
from sqlalchemy.exc import ArgumentError

from fallbackgate.policy.loader import PolicyError, format_errors, load_policy
from fallbackgate.policy.schema import Policy

# command-line flag (argparse dest) -> (policy section, field); a flag given on the command line wins
OVERRIDES: dict[str, tuple[str, str]] = {
    "device_budget_mb": ("memory", "device_budget_mb"),
    "host_budget_mb": ("memory", "host_budget_mb"),
    "spill_dir": ("memory", "spill_dir"),
    "block_size": ("memory", "block_size"),
    "max_num_seqs": ("memory", "max_num_seqs"),
    "preempt": ("memory", "preempt_mode"),
    "max_model_len": ("memory", "max_model_len"),
    "prefix_reuse": ("memory", "prefix_reuse"),
    "prefix_cache_mb": ("memory", "prefix_cache_mb"),
    "profile": ("hardware", "profile"),
    "audit_rate": ("audit", "sample_rate"),
    "mode": ("audit", "mode"),
    "ledger": ("ledger", "url"),
    "controller": ("controller", "kind"),
}


def with_sections(policy: Policy, sections: dict[str, dict[str, Any]], model: str | None = None) -> Policy:
    """A validated copy of `policy` with the fields of `sections` (section -> field -> value) replaced and,
    when given, its model."""
    data = policy.model_dump()
    for section, fields in sections.items():
        data[section].update(fields)
    if model is not None:
        data["model"] = model
    return Policy.model_validate(data)


def merge_args(policy: Policy, args: argparse.Namespace) -> Policy:
    """A copy of `policy` with every explicitly given flag applied (flags left at None keep the policy's value)."""
    updates: dict[str, dict[str, Any]] = {}
    for dest, (section, field) in OVERRIDES.items():
        value = getattr(args, dest, None)
        if value is not None:
            updates.setdefault(section, {})[field] = value
    return with_sections(policy, updates, getattr(args, "model", None))


def policy_from_args(args: argparse.Namespace, default: Policy | None = None) -> Policy:
    """Load ``args.policy`` (None: `default`, else ``Policy()``) and apply the flags given on the command
    line (errors name the field)."""
    path = getattr(args, "policy", None)
    policy = load_policy(path) if path is not None else default or Policy()
    try:
        return merge_args(policy, args)
    except ValidationError as exc:
        source = f"{path} with command-line overrides" if path is not None else "command-line flags"
        raise PolicyError(source, format_errors(exc)) from None


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

"""``fallbackgate policy schema`` (JSON Schema for editors) and ``fallbackgate policy check FILE``.

``check`` exits 0 for a valid policy (printing a summary), 2 with one line per problem otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from fallbackgate.commands.checks import check_output_path
from fallbackgate.policy import Policy, PolicyError, json_schema, load_policy


def add_parser(subparsers: Any) -> None:
    """Register ``policy`` with its ``schema`` and ``check`` subcommands."""
    p: argparse.ArgumentParser = subparsers.add_parser("policy", help="policy file schema and checker")
    sub = p.add_subparsers(dest="policy_command", required=True)
    schema = sub.add_parser("schema", help="print the policy JSON Schema")
    schema.add_argument("--output", default=None, help="write to this file instead of stdout")
    schema.set_defaults(func=run_schema)
    check = sub.add_parser("check", help="validate a policy file; errors name the field")
    check.add_argument("file", help="policy YAML")
    check.set_defaults(func=run_check)


def run_schema(args: argparse.Namespace) -> int:
    """Print (or write) the JSON Schema."""
    text = json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"
    if args.output:
        try:
            check_output_path(args.output, "--output")
        except ValueError as exc:
            print(f"fallbackgate policy schema: error: {exc}", file=sys.stderr)
            return 2
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


def summary(policy: Policy) -> list[str]:
    """Human-readable lines describing a valid policy."""
    mem = policy.memory
    lines = [
        f"controller {policy.controller.kind}, mode {policy.audit.mode}, audit rate {policy.audit.sample_rate:g}",
        f"hardware {policy.hardware.profile}, device budget "
        f"{'unlimited' if mem.device_budget_mb is None else f'{mem.device_budget_mb:g} MiB'}",
    ]
    for name, cls in policy.classes.items():
        tags = ", ".join(cls.budget.allowed_tags) or "exact only"
        lines.append(
            f"class {name}: TPOT {cls.slo.tpot_ms:g} ms, TTFT {cls.slo.ttft_ms:g} ms, "
            f"mean KL <= {cls.budget.max_mean_kl:g}, p99 KL <= {cls.budget.max_p99_kl:g}, tags: {tags}"
        )
    return lines


def run_check(args: argparse.Namespace) -> int:
    """Validate one file."""
    try:
        policy = load_policy(args.file)
    except PolicyError as exc:
        print(f"fallbackgate policy check: {exc}", file=sys.stderr)
        return 2
    print(f"{args.file}: ok")
    for line in summary(policy):
        print(f"  {line}")
    return 0

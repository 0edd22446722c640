"""The bundled demo: what ``fallbackgate run`` serves with when given no policy, no model, no budget and no
controller, mode or forced tag: the bundled model under memory pressure (``policies/demo.yaml``)."""

from __future__ import annotations

import argparse
import math
import pathlib
from typing import Any, TextIO

from fallbackgate.audit.gate import RunVerdict
from fallbackgate.batch.prompts import PromptSpec
from fallbackgate.batch.report import tag_totals
from fallbackgate.batch.session import RunOutcome
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.tags import TAG_EXACTNESS, Tag

DEMO_POLICY = pathlib.Path(__file__).resolve().parent.parent / "policies" / "demo.yaml"
"""The demo's policy: joint controller in enforce mode, a RAM budget short of the bundled experts and their KV."""

_FLAGS_THAT_LEAVE_THE_DEMO = ("policy", "model", "device_budget_mb", "host_budget_mb", "controller", "mode")


def is_demo_run(args: argparse.Namespace) -> bool:
    """True for the embedded default: none of the flags that choose a policy, model, budget or controller."""
    return all(getattr(args, name, None) is None for name in _FLAGS_THAT_LEAVE_THE_DEMO) and not args.force


def demand_bytes(engine: Engine, specs: list[PromptSpec], max_new_tokens: int) -> tuple[int, int]:
    """(every expert's bytes, the KV blocks the demo's requests need at their full length)."""
    store = engine.kv_store
    num_blocks = 0
    for spec in specs:
        num_tokens = len(engine.tokenizer.encode(spec.prompt)) + (spec.max_new_tokens or max_new_tokens)
        num_blocks += math.ceil(num_tokens / store.block_size) * store.num_layers
    experts = engine.expert_store
    return len(experts.reader.sources) * experts.bytes_per_expert, num_blocks * store.bytes_per_block


def print_demo_budget(engine: Engine, specs: list[PromptSpec], max_new_tokens: int, out: TextIO) -> None:
    """One line: the demo's RAM budget against what holding everything would take."""
    expert_bytes, kv_bytes = demand_bytes(engine, specs, max_new_tokens)
    budget = engine.config.device_budget_bytes or 0
    mib = 2**20
    print(
        f"demo budget: {budget / mib:.2f} MiB of {(expert_bytes + kv_bytes) / mib:.2f} MiB experts+KV "
        f"(experts {expert_bytes / mib:.2f} MiB, KV of these requests {kv_bytes / mib:.2f} MiB): short "
        f"{(expert_bytes + kv_bytes - budget) / mib:.2f} MiB; give --device-budget-mb or --policy to choose",
        file=out,
    )


def print_demo_recap(
    outcome: RunOutcome, verdict: RunVerdict, budgets: dict[str, dict[str, Any]], out: TextIO
) -> None:
    """The demo in a few lines: which fallbacks and how often, their audited cost above the floor against the
    class's quality budget, and the verdict."""
    counts = {tag: total for tag, total in tag_totals(outcome).items() if total["count"] and tag != "resident"}
    moved = ", ".join(
        f"{tag} x{total['count']} ({TAG_EXACTNESS[Tag(tag)].value}, {total['bytes'] / 2**20:.2f} MiB)"
        for tag, total in counts.items()
    )
    print(f"demo fallbacks: {moved or 'none'}", file=out)
    worst = max(verdict.requests, key=lambda v: (v.stats or {}).get("mean_kl", 0.0), default=None)
    floor = verdict.floor.mean_kl if verdict.floor is not None else 0.0
    limit = budgets.get("default", {}).get("max_mean_kl")
    if worst is not None and worst.stats:
        print(
            f"demo audited cost: worst request {worst.request_id} ({worst.served.value}) mean KL "
            f"{worst.stats.get('mean_kl', 0.0):.3g} against the exact baseline (floor {floor:.3g}, class budget "
            f"{limit if limit is not None else 'none'}); verdict {'PASS' if verdict.passed else 'FAIL'}",
            file=out,
        )

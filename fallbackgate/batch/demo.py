"""The bundled demo: what ``fallbackgate run`` serves with when given no policy, no model, no budget and no
controller, mode or forced tag: the bundled model under memory pressure (``policies/demo.yaml``)."""

from __future__ import annotations

import argparse
import math
import pathlib
from typing import TextIO

from fallbackgate.batch.prompts import PromptSpec
from fallbackgate.engine.engine import Engine

DEMO_POLICY = pathlib.Path(__file__).resolve().parent.parent / "policies" / "demo.yaml"
"""The demo's policy: joint controller in enforce mode, a RAM budget of about half the bundled experts."""

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

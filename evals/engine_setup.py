"""Build the engine an evaluation runs on: a policy's engine, or the exact baseline that mirrors it.

The exact baseline keeps the policy's batching knobs (block size, running requests, preemption mode) so
that both engines pack the same requests into the same steps, but serves every object at full precision:
exact-only LRU controller, no device budget (everything resident), enforce mode, exact-only budgets.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

from fallbackgate.batch.session import RunSettings
from fallbackgate.engine.engine import Engine
from fallbackgate.policy import Policy
from fallbackgate.policy.apply import build_policy_engine, class_budgets
from fallbackgate.tinymoe import CHECKPOINT_DIR

SCORING_BATCH_TOKENS = 4096  # at least the longest window (prompt + continuation) the adapter scores


@dataclasses.dataclass
class EngineSetup:
    """An engine plus what the ledger and the gate need to know about how it was built."""

    engine: Engine
    policy: Policy
    policy_name: str  # file path, or "exact-baseline(<file>)"
    controller_name: str
    budgets: dict[str, dict[str, Any]]
    audit_rate: float
    request_class: str
    ledger_url: str | None


def exact_counterpart(policy: Policy) -> Policy:
    """The exact baseline of `policy`: same model and batching knobs, everything resident, exact only."""
    data = policy.model_dump()
    data["memory"].update(device_budget_mb=None, host_budget_mb=None)
    data["controller"] = {"kind": "exact_lru", "kv_quant_bits": policy.controller.kv_quant_bits}
    data["audit"]["mode"] = "enforce"
    for cls in data["classes"].values():
        cls["budget"] = {}  # the schema default: exact only
    return Policy.model_validate(data)


def build_setup(
    model_dir: str | None = None,
    policy: str | pathlib.Path | Policy | None = None,
    device_budget_mb: float | None = None,
    force: list[str] | None = None,
    exact_baseline: bool = False,
    policy_name: str | None = None,
    chunk_tokens: int = SCORING_BATCH_TOKENS,
) -> EngineSetup:
    """Load the policy (a path or a parsed one; None: the default exact policy) and build its engine.

    `exact_baseline` builds :func:`exact_counterpart` instead; `force` forces fallback tags on an
    ``exact_lru`` policy (as ``fallbackgate run --force``); `device_budget_mb` overrides the policy's.
    `chunk_tokens` is the engine's tokens per forward: the default scores a whole window in one forward
    (hf's summation order); smaller values split windows into prefill chunks whose later chunks read the
    earlier chunks' KV through the policy's fallbacks.
    """
    if isinstance(policy, str | pathlib.Path):
        from fallbackgate.evals.tolerances import load_parity_policy

        policy_name = policy_name or str(policy)
        policy, _ = load_parity_policy(policy)
    policy = policy or exact_counterpart(Policy(controller={"kind": "exact_lru"}))
    policy_name = policy_name or "(default exact policy)"
    if device_budget_mb is not None:
        policy = policy.model_copy(
            update={"memory": policy.memory.model_copy(update={"device_budget_mb": device_budget_mb})}
        )
    # the baseline computes as the policy's exact path does: stacked grouped_mm experts only when the policy
    # itself has no device budget (everything fits), else one expert at a time (same kernels, bitwise)
    is_stacked = policy.memory.device_budget_mb is None and not force
    if exact_baseline:
        policy, policy_name, force = exact_counterpart(policy), f"exact-baseline({policy_name})", []
    if force and policy.controller.kind != "exact_lru":
        raise ValueError(f"force={force} needs an exact_lru policy, not controller {policy.controller.kind!r}")
    mem = policy.memory
    settings = RunSettings(
        model_dir or policy.model or str(CHECKPOINT_DIR),
        block_size=mem.block_size,
        max_num_seqs=mem.max_num_seqs,
        device_budget_mb=mem.device_budget_mb,
        host_budget_mb=mem.host_budget_mb,
        spill_dir=mem.spill_dir,
        profile=policy.hardware.profile,
        preempt_mode=mem.preempt_mode,
        # a whole scoring window in one forward, as lm-eval's hf model computes it (same summation order)
        max_num_batched_tokens=chunk_tokens,
        is_stacked_when_fits=is_stacked,
    )
    engine, controller = build_policy_engine(policy, settings, None, list(force or []))
    name = policy.controller.kind + (f" force={'|'.join(force)}" if force else "")
    return EngineSetup(
        engine,
        policy,
        policy_name,
        name,
        class_budgets(policy),
        policy.audit.sample_rate,
        policy.default_class,
        policy.ledger.url,
    )

"""Build the engine an evaluation runs on: a policy's engine, or the exact baseline that mirrors it.

The exact baseline keeps the policy's batching knobs (block size, running requests, preemption mode) so
that both engines pack the same requests into the same steps, but serves every object at full precision:
exact-only LRU controller, no device budget (everything resident), enforce mode, exact-only budgets.
"""

from __future__ import annotations

import dataclasses
import pathlib

from fallbackgate.assembly import Assembly, Overrides, assemble, no_policy
from fallbackgate.engine.engine import Engine
from fallbackgate.policy import Policy
from fallbackgate.policy.apply import with_sections
from fallbackgate.policy.schema import AuditMode, ControllerKind

SCORING_BATCH_TOKENS = 4096  # at least the longest window (prompt + continuation) the adapter scores


@dataclasses.dataclass(kw_only=True, slots=True)
class EngineSetup:
    """An assembled engine plus how the parity report names it."""

    assembly: Assembly  # the engine, its policy (name: file path, or "exact-baseline(<file>)") and classes
    controller_name: str  # the controller kind, with " force=a|b" when tags are forced
    ledger_url: str | None  # the policy's ledger (None: $FALLBACKGATE_LEDGER or the default)

    @property
    def engine(self) -> Engine:
        """The engine."""
        return self.assembly.engine

    @property
    def policy(self) -> Policy:
        """The effective policy."""
        return self.assembly.policy

    @property
    def request_class(self) -> str:
        """The class every evaluation request is served in: the policy's default."""
        return self.assembly.classes.default


def exact_counterpart(policy: Policy) -> Policy:
    """The exact baseline of `policy`: same model and batching knobs, everything resident, exact only."""
    data = policy.model_dump()
    data["memory"].update(device_budget_mb=None, host_budget_mb=None)
    data["controller"] = {"kind": ControllerKind.EXACT_LRU.value, "kv_quant_bits": policy.controller.kv_quant_bits}
    data["audit"]["mode"] = AuditMode.ENFORCE.value
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
    policy = policy or exact_counterpart(no_policy())
    policy_name = policy_name or "(default exact policy)"
    if device_budget_mb is not None:
        policy = with_sections(policy, {"memory": {"device_budget_mb": device_budget_mb}})
    if model_dir is not None:
        policy = with_sections(policy, {}, model=model_dir)
    force = list(force or [])
    # the baseline computes as the policy's exact path does: stacked grouped_mm experts only when the policy
    # itself has no device budget (everything fits), else one expert at a time (same kernels, bitwise)
    is_stacked = policy.memory.device_budget_mb is None and not force
    if exact_baseline:
        policy, policy_name, force = exact_counterpart(policy), f"exact-baseline({policy_name})", []
    overrides = Overrides(
        force=tuple(force),
        # a whole scoring window in one forward, as lm-eval's hf model computes it (same summation order)
        max_num_batched_tokens=chunk_tokens,
        is_stacked_when_fits=is_stacked if exact_baseline else None,
    )
    built = assemble(policy, overrides, policy_name=policy_name)
    name = policy.controller.kind + (f" force={'|'.join(force)}" if force else "")
    return EngineSetup(assembly=built, controller_name=name, ledger_url=policy.ledger.url)

"""Dual-miss arbitration: when a step's exact KV copies would arrive after its deadline, on measured time.

KV blocks with a full-precision copy queue on the link before expert misses. One that no longer fits the
step's link time competes with the step's expert loads; if the request's class allows it, the block falls
back to the option the measured profile predicts fastest among those that fit: ``recompute`` (the same
math: the request's tokens from the block on run again; compute time) or ``kv_dequant`` from a quantized
copy (the bytes it is stored in: int8 or packed int4 codes with their scales; its predicted quality cost
against the request's budget). Otherwise the exact copy loads late and the slip is recorded. Every choice is
kept with its reason.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from fallbackgate.controllers.cost import CostModel
from fallbackgate.controllers.link import LinkBudget
from fallbackgate.engine.controller import ControllerView, Decision, KVBlockInfo
from fallbackgate.engine.hardware import HardwareProfile
from fallbackgate.engine.kv.block import KVBlockKey
from fallbackgate.engine.tags import Tag, Tier
from fallbackgate.policy.budgets import RequestBudget


@dataclasses.dataclass(slots=True)
class Arbitration:
    """One late exact KV copy and what the controller served instead (or why it did not)."""

    step_id: int  # step of the decision
    block_key: KVBlockKey  # (request id, layer, block index)
    choice: Tag  # recompute, kv_dequant, or exact_load (late)
    reason: str  # predicted times and the deciding limit


class StepState(Protocol):
    """The joint controller's state for the current step that an arbitration reads and spends."""

    step_id: int  # current step
    top_k: int  # experts per token
    cost: CostModel  # predicted quality cost of approximate actions
    link: LinkBudget  # link time left in this step
    cpu_left_s: float  # CPU time left in this step (a rebuild pass spends it)
    recomputing: set[str]  # requests whose rebuild pass this step is already charged
    kv_plan: dict[KVBlockKey, Decision]  # late exact KV copies served otherwise this step

    def kv_error_energy(self, key: KVBlockKey, bits: int) -> float:
        """Relative error energy of the block's quantized copy (cached per block)."""
        ...


def recompute_s(profile: HardwareProfile, view: ControllerView, num_tokens: int, top_k: int) -> float:
    """Predicted seconds to run `num_tokens` tokens again through every layer (dense part and experts)."""
    layers = view.num_layers
    uses = min(max(1, view.num_experts), num_tokens * top_k)
    per_expert_tokens = max(1, num_tokens * top_k // uses)
    params, dtype = view.num_expert_params, view.compute_dtype
    expert = profile.expert_s(per_expert_tokens, view.bytes_per_expert, params, on_cpu=False, dtype=dtype)
    return profile.dense_step_s(layers, 0.0) + layers * uses * expert


def arbitrate(
    ctrl: StepState, block: KVBlockInfo, budget: RequestBudget, start: int, view: ControllerView
) -> Arbitration | None:
    """Decide a late exact copy of an off-device block; None when the copy still arrives in time (its link
    time is taken)."""
    link, block_bytes, source = ctrl.link, view.bytes_per_kv_block, block.exact_tier
    if link.fits(block_bytes, source):
        link.take(block_bytes, source)
        return None
    load_ms = 1e3 * sum(link.legs(block_bytes, source).values())
    left_ms = 1e3 * max(0.0, link.left_s.get(Tier.HOST, 0.0))
    late = f"exact copy late ({load_ms:.3f} ms of link, {left_ms:.3f} ms left)"
    options: list[tuple[float, Tag, float]] = []  # (predicted seconds, tag, predicted nats)
    tags = budget.limits.allowed_tags
    if Tag.RECOMPUTE.value in tags:  # one rebuild pass per request covers all its late blocks: charged once
        is_charged = block.key[0] in ctrl.recomputing
        seconds = recompute_s(link.profile, view, max(1, start - block.key[2] * view.block_size), ctrl.top_k)
        if is_charged or seconds <= ctrl.cpu_left_s:
            options.append((0.0 if is_charged else seconds, Tag.RECOMPUTE, 0.0))
    if block.quant_tier is not None and Tag.KV_DEQUANT.value in tags:
        quant_source, quant_bytes = block.quant_tier, block.quant_bytes
        cost = ctrl.cost.kv_cost(block.key[1], ctrl.kv_error_energy(block.key, block.quant_bits))
        if link.fits(quant_bytes, quant_source) and budget.fits(Tag.KV_DEQUANT, cost):
            options.append((sum(link.legs(quant_bytes, quant_source).values()), Tag.KV_DEQUANT, cost))
    if not options:
        link.take(block_bytes, source)
        return Arbitration(ctrl.step_id, block.key, Tag.EXACT_LOAD, f"{late}; no allowed fallback fits: slo slip")
    seconds, tag, cost = min(options, key=lambda o: (o[0], o[2]))
    if tag is Tag.RECOMPUTE:
        ctrl.cpu_left_s -= seconds
        ctrl.recomputing.add(block.key[0])
    else:
        link.take(block.quant_bytes, block.quant_tier)
    budget.spend(tag, cost, False)  # spent when planned, so the next late block sees what is left
    ctrl.kv_plan[block.key] = Decision(tag, cost, f"{late}; {tag.value} predicted {1e3 * seconds:.3f} ms")
    return Arbitration(ctrl.step_id, block.key, tag, ctrl.kv_plan[block.key].reason)

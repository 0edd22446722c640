"""Dual-miss arbitration: when a step's exact KV copies would arrive after its deadline, on measured time.

KV blocks with a full-precision copy queue on the link before expert misses. One that no longer fits the
step's link time competes with the step's expert loads; if the request's class allows it, the block falls
back to the option the measured profile predicts fastest among those that fit: ``recompute`` (the same
math: the request's tokens from the block on run again; compute time) or ``kv_dequant`` from a quantized
copy (a quarter or an eighth of the bytes, with its predicted quality cost against the request's budget).
Otherwise the exact copy loads late and the slip is recorded. Every choice is kept with its reason.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from fallbackgate.engine.controller import Decision, EngineView
from fallbackgate.engine.hardware import HardwareProfile
from fallbackgate.engine.kv.block import KVBlock
from fallbackgate.engine.kv.store import KVBlockKey
from fallbackgate.engine.tags import Tag, Tier

if TYPE_CHECKING:
    from fallbackgate.controllers.joint import JointController
    from fallbackgate.policy.budgets import RequestBudget


@dataclasses.dataclass(slots=True)
class Arbitration:
    """One late exact KV copy and what the controller served instead (or why it did not)."""

    step_id: int  # step of the decision
    block_key: KVBlockKey  # (request id, layer, block index)
    choice: Tag  # recompute, kv_dequant, or exact_load (late)
    reason: str  # predicted times and the deciding limit


def recompute_s(profile: HardwareProfile, view: EngineView, num_tokens: int, top_k: int) -> float:
    """Predicted seconds to run `num_tokens` tokens again through every layer (dense part and experts)."""
    store, layers = view.expert_store, view.kv_store.num_layers
    num_experts = max(1, len({e for _, e in store.entries}))
    uses = min(num_experts, num_tokens * top_k)
    per_expert_tokens = max(1, num_tokens * top_k // uses)
    dtype = str(store.reader.compute_dtype).removeprefix("torch.")
    params = store.bytes_per_expert // store.reader.compute_dtype.itemsize
    expert = profile.expert_s(per_expert_tokens, store.bytes_per_expert, params, on_cpu=False, dtype=dtype)
    return profile.dense_step_s(layers, 0.0) + layers * uses * expert


def arbitrate(
    ctrl: JointController, block: KVBlock, budget: RequestBudget, start: int, view: EngineView
) -> Arbitration | None:
    """Decide a late exact KV copy; None when the copy still arrives in time (its link time is taken)."""
    kv, link = view.kv_store, ctrl.link
    source = Tier.HOST if block.host is not None else Tier.DISK
    if link.fits(kv.bytes_per_block, source):
        link.take(kv.bytes_per_block, source)
        return None
    load_ms = 1e3 * sum(link.legs(kv.bytes_per_block, source).values())
    left_ms = 1e3 * max(0.0, link.left_s.get(Tier.HOST, 0.0))
    late = f"exact copy late ({load_ms:.3f} ms of link, {left_ms:.3f} ms left)"
    options: list[tuple[float, Tag, float]] = []  # (predicted seconds, tag, predicted nats)
    tags = budget.limits.allowed_tags
    if "recompute" in tags:  # one rebuild pass per request covers all its late blocks: charged once
        is_charged = block.key[0] in ctrl.recomputing
        seconds = recompute_s(link.profile, view, max(1, start - block.key[2] * kv.block_size), ctrl.top_k)
        if is_charged or seconds <= ctrl.cpu_left_s:
            options.append((0.0 if is_charged else seconds, Tag.RECOMPUTE, 0.0))
    quant = block.host_q or block.disk_q
    if quant is not None and "kv_dequant" in tags:
        quant_source = Tier.HOST if block.host_q is not None else Tier.DISK
        quant_bytes = quant.num_bytes
        cost = ctrl.cost.kv_cost(block.key[1], ctrl.kv_energy.get(block.key) or ctrl._energy(block.key, quant.bits))
        if link.fits(quant_bytes, quant_source) and budget.fits(Tag.KV_DEQUANT, cost):
            options.append((sum(link.legs(quant_bytes, quant_source).values()), Tag.KV_DEQUANT, cost))
    if not options:
        link.take(kv.bytes_per_block, source)
        return Arbitration(ctrl.step_id, block.key, Tag.EXACT_LOAD, f"{late}; no allowed fallback fits: slo slip")
    seconds, tag, cost = min(options, key=lambda o: (o[0], o[2]))
    if tag is Tag.RECOMPUTE:
        ctrl.cpu_left_s -= seconds
        ctrl.recomputing.add(block.key[0])
    else:
        link.take(quant.num_bytes, Tier.HOST if block.host_q is not None else Tier.DISK)
    budget.spend(tag, cost, False)  # spent when planned, so the next late block sees what is left
    ctrl.kv_plan[block.key] = Decision(tag, cost, f"{late}; {tag.value} predicted {1e3 * seconds:.3f} ms")
    return Arbitration(ctrl.step_id, block.key, tag, ctrl.kv_plan[block.key].reason)

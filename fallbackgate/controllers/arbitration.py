"""Dual-miss arbitration: when a step's exact KV copies would arrive after its deadline, on measured time.

KV blocks with a full-precision copy queue on the link before expert misses. One that no longer fits the
step's link time competes with the step's expert loads; if the request's class allows it, the block falls
back to the option the measured profile predicts fastest among those that fit: ``recompute`` (the same
math: the request's tokens from the block on run again; compute time) or ``kv_dequant`` from a quantized
copy (the bytes it is stored in: int8 or packed int4 codes with their scales; its predicted quality cost
against the request's budget). Otherwise the exact copy loads late and the slip is recorded. An expert load
that arrives late is arbitrated by the joint controller among its expert fallbacks
(:func:`expert_arbitration` records it). Every choice is kept with every option weighed, its predicted
arrival against the step's deadline, and its reason; the run recorder writes them to the ledger.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from fallbackgate.controllers.cost import CostModel
from fallbackgate.controllers.link import LinkBudget
from fallbackgate.engine.controller import ControllerView, Decision, ExpertMiss, KVBlockInfo
from fallbackgate.engine.hardware import HardwareProfile
from fallbackgate.engine.kv.block import KVBlockKey
from fallbackgate.engine.tags import ObjectKind, Tag, Tier
from fallbackgate.policy.budgets import RequestBudget


@dataclasses.dataclass(frozen=True, slots=True)
class ArbitrationOption:
    """One way to serve a late object, as the controller weighed it."""

    tag: Tag  # exact_load (late); for a KV block recompute or kv_dequant; for an expert a fallback tag
    predicted_s: float  # predicted seconds of link (loads, kv_dequant, expert_lowbit) or CPU (recompute,
    # cpu_execute) it takes; 0 for expert_defer
    predicted_cost: float  # predicted quality cost in nats (0 for exact and equivalent tags)
    is_feasible: bool  # allowed by the request's class and fits the step's time and the quality budget
    note: str = ""  # why it is not feasible ("" when it is)


@dataclasses.dataclass(slots=True)
class Arbitration:
    """One late object (an exact KV copy or an expert load), the options, and what the controller served
    instead (or why it did not)."""

    step_id: int  # step of the decision
    object_key: tuple[str, int, int]  # (request id, layer, KV block index or expert id)
    choice: Tag  # the tag served: a fallback, or exact_load (late)
    reason: str  # predicted times and the deciding limit
    late: str = ""  # what was late: the exact copy's link time against the link time left
    options: tuple[ArbitrationOption, ...] = ()  # every option weighed, the chosen one among them
    deadline_s: float = 0.0  # the step's link time, seconds from the step's start
    predicted_arrival_s: float = 0.0  # when the choice was predicted usable, seconds from the step's start
    predicted_cost: float = 0.0  # predicted nats of the choice
    object_kind: ObjectKind = ObjectKind.KV_BLOCK  # what was late


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
    """Predicted seconds to run `num_tokens` tokens again through every layer (dense part and experts), and
    to load the experts that pass needs and the device does not hold: its distinct experts per layer times
    the share of experts off device, each at one expert's load time (a rebuild is not free where experts
    are short)."""
    layers, expert_layers = view.num_layers, view.num_expert_layers
    uses = min(max(1, view.num_experts), num_tokens * top_k)
    per_expert_tokens = max(1, num_tokens * top_k // uses)
    params, dtype = view.num_expert_params, view.compute_dtype
    expert = profile.expert_s(per_expert_tokens, view.bytes_per_expert, params, on_cpu=False, dtype=dtype)
    num_resident = view.device_used_bytes(ObjectKind.EXPERT) // max(1, view.bytes_per_expert)
    off_share = max(0.0, 1.0 - num_resident / max(1, expert_layers * view.num_experts))
    load_s = profile.transfer_s(view.bytes_per_expert, Tier.DISK if view.is_ram_tiered else Tier.HOST)
    return profile.dense_step_s(layers, 0.0) + expert_layers * uses * (expert + off_share * load_s)


def arbitrate(
    ctrl: StepState, block: KVBlockInfo, budget: RequestBudget, start: int, view: ControllerView
) -> Arbitration | None:
    """Decide a late exact copy of an off-device block; None when the copy still arrives in time (its link
    time is taken)."""
    link, block_bytes, source = ctrl.link, view.bytes_per_kv_block, block.exact_tier
    if link.fits(block_bytes, source):
        link.take(block_bytes, source)
        return None
    load_s = sum(link.legs(block_bytes, source).values())
    late = link.late_text("exact copy", block_bytes, source)
    options = [ArbitrationOption(Tag.EXACT_LOAD, load_s, 0.0, False, "arrives after the deadline")]
    options += [_recompute_option(ctrl, block, budget, start, view), _dequant_option(ctrl, block, budget, load_s)]
    feasible = [o for o in options if o.is_feasible]
    if not feasible:
        link.take(block_bytes, source)
        reason = f"{late}; no allowed fallback fits: slo slip"
        return _decided(ctrl, block, Tag.EXACT_LOAD, reason, late, options, link.used_s(source), 0.0)
    chosen = min(feasible, key=lambda o: (o.predicted_s, o.predicted_cost))
    if chosen.tag is Tag.RECOMPUTE:
        ctrl.cpu_left_s -= chosen.predicted_s
        ctrl.recomputing.add(block.key[0])
        arrival = link.deadline_s - ctrl.cpu_left_s
    else:
        link.take(block.quant_bytes, block.quant_tier)
        arrival = link.used_s(block.quant_tier)
    budget.spend(chosen.tag, chosen.predicted_cost, False)  # spent when planned: the next late block sees the rest
    reason = f"{late}; {chosen.tag.value} predicted {1e3 * chosen.predicted_s:.3f} ms"
    ctrl.kv_plan[block.key] = Decision(chosen.tag, chosen.predicted_cost, reason)
    return _decided(ctrl, block, chosen.tag, reason, late, options, arrival, chosen.predicted_cost)


def _recompute_option(
    ctrl: StepState, block: KVBlockInfo, budget: RequestBudget, start: int, view: ControllerView
) -> ArbitrationOption:
    """Rebuild from tokens: one pass per request covers all its late blocks, so it is charged once."""
    is_charged = block.key[0] in ctrl.recomputing
    seconds = recompute_s(ctrl.link.profile, view, max(1, start - block.key[2] * view.block_size), ctrl.top_k)
    seconds = 0.0 if is_charged else seconds
    if Tag.RECOMPUTE.value not in budget.limits.allowed_tags:
        return ArbitrationOption(Tag.RECOMPUTE, seconds, 0.0, False, "not allowed for the class")
    if not is_charged and seconds > ctrl.cpu_left_s:
        return ArbitrationOption(Tag.RECOMPUTE, seconds, 0.0, False, "past the step's CPU time")
    return ArbitrationOption(Tag.RECOMPUTE, seconds, 0.0, True)


def _dequant_option(
    ctrl: StepState, block: KVBlockInfo, budget: RequestBudget, exact_s: float
) -> ArbitrationOption:
    """Read the quantized copy: its bytes on its link, its predicted cost against the budget; feasible when it
    arrives in time or sooner than the late exact copy (`exact_s` seconds) would."""
    if block.quant_tier is None:
        return ArbitrationOption(Tag.KV_DEQUANT, 0.0, 0.0, False, "no quantized copy")
    link, quant_bytes = ctrl.link, block.quant_bytes
    seconds = sum(link.legs(quant_bytes, block.quant_tier).values())
    cost = ctrl.cost.kv_cost(block.key[1], ctrl.kv_error_energy(block.key, block.quant_bits))
    if Tag.KV_DEQUANT.value not in budget.limits.allowed_tags:
        return ArbitrationOption(Tag.KV_DEQUANT, seconds, cost, False, "not allowed for the class")
    if not link.fits(quant_bytes, block.quant_tier) and seconds >= exact_s:
        return ArbitrationOption(Tag.KV_DEQUANT, seconds, cost, False, "arrives after the deadline")
    why_not = budget.why_not(Tag.KV_DEQUANT, cost)
    return ArbitrationOption(Tag.KV_DEQUANT, seconds, cost, not why_not, why_not)


def _decided(
    ctrl: StepState,
    block: KVBlockInfo,
    choice: Tag,
    reason: str,
    late: str,
    options: list[ArbitrationOption],
    arrival_s: float,
    cost: float,
) -> Arbitration:
    deadline = ctrl.link.deadline_s
    return Arbitration(ctrl.step_id, block.key, choice, reason, late, tuple(options), deadline, arrival_s, cost)


def expert_arbitration(
    step_id: int,
    miss: ExpertMiss,
    link: LinkBudget,
    late: tuple[float, str],
    weighed: list[tuple[Tag, float, float, str]],
    chosen: tuple[Tag, float, float],
    reason: str,
) -> Arbitration:
    """A late expert load's arbitration: the late load (its link seconds and why it is late, taken before
    anything was booked for it), every fallback weighed as (tag, predicted seconds,
    predicted nats, why it is not feasible: "" when it is), and the choice as (tag, predicted nats, predicted
    arrival in seconds from the step's start)."""
    choice, cost, arrival_s = chosen
    late_s, late_text = late
    options = [ArbitrationOption(Tag.EXACT_LOAD, late_s, 0.0, False, "arrives after the deadline")]
    for tag, seconds, option_cost, note in weighed:
        options.append(ArbitrationOption(tag, seconds, option_cost, not note, note))
    key = (miss.request_id, miss.layer, miss.expert_id)
    deadline = link.deadline_s
    return Arbitration(
        step_id, key, choice, reason, late_text, tuple(options), deadline, arrival_s, cost, ObjectKind.EXPERT
    )

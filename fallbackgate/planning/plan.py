"""``fallbackgate plan``'s model: fit, memory split, predicted TTFT/TPOT and hit rate, fallbacks per class.

From a :class:`ModelShape` and a hardware profile (measured on this machine by default), for a workload
of `concurrency` requests of `context` tokens each:

- **fit**: dense weights stay resident outside the budget; the device budget must hold the expert floor
  (top-k experts) plus the KV of every request (blocks of `block_size` tokens per layer) plus one layer's
  gathered K/V; what is left becomes expert slots (all experts: everything fits);
- **hit rate**: an expert is on device at a step's start with probability (slots / experts) ** alpha
  (alpha 1: uniform routing; fitted from the model's recorded runs when a ledger is given, see
  ``history.py``); a use hits when its expert was, or when another request loaded it earlier in the step;
- **TPOT** (one decode step, every request one token): the dense part (the profile's per-layer cost and
  matmul rate), per MoE layer the unique experts the batch routes to (E·(1−(1−k/E)^B)) computed with the
  measured expert curve, and the misses among them moved from their home (host cache, else disk);
- **TTFT**: every request's prompt packed into prefill chunks of 256 tokens (requests arriving together);
- **fallbacks per class**: when the exact TPOT misses a class's SLO, the first of the class's allowed
  fallbacks that meets it (cpu_execute on host, expert_lowbit, expert_defer of the misses), with its
  predicted quality cost per token from the controllers' cost model (default or calibrated scales);
- **tiers** (`Workload.layout`): on a CPU (``TierLayout.RAM_DISK``) RAM is the one budgeted tier (the device
  budget) and the disk the other: a miss is one disk read into RAM at the disk's measured rate, there is no
  host tier (a host budget is refused, as the engine refuses it) and no cpu_execute (the experts compute on
  the CPU already); low-bit misses read their low-bit bytes from the disk (the engine's low-bit cache).

KV fallbacks and preemption are not planned; time is the profile's prediction (modeled), as `plan` says.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fallbackgate.controllers.cost import CostModel
from fallbackgate.engine.config import TierLayout
from fallbackgate.engine.hardware import HardwareProfile
from fallbackgate.engine.tags import Tag, Tier
from fallbackgate.planning.shape import ModelShape

PREFILL_CHUNK = 256  # tokens per prefill forward (the engine's default max_num_batched_tokens)
FALLBACK_ORDER = (Tag.CPU_EXECUTE, Tag.EXPERT_LOWBIT, Tag.EXPERT_DEFER)  # cheapest in quality first
RAM_DISK_NOTE = (
    "tiers: RAM (the one budget) and the disk: the device is the CPU, so there is no host tier and no "
    "cpu_execute (the experts compute in RAM on the CPU already); a miss is one disk read into RAM"
)


@dataclasses.dataclass(slots=True)
class Workload:
    """What the plan is for."""

    context: int  # tokens per request (prompt + output)
    concurrency: int  # requests decoded together
    device_budget_bytes: int | None  # None: everything fits on device
    host_budget_bytes: int | None  # None: every expert cached in host memory
    block_size: int = 16
    lowbit_bits: int = 8
    prompt_tokens: int | None = None  # of the context (default: half of it)
    routing_exponent: float = 1.0  # hit = (slots / experts) ** this (1: uniform; fitted from recorded runs)
    layout: TierLayout = TierLayout.DEVICE_HOST_DISK  # the engine's tiers (RAM_DISK: a CPU)

    def __post_init__(self) -> None:
        if self.layout is TierLayout.RAM_DISK and self.host_budget_bytes:
            raise ValueError(
                f"a host budget ({self.host_budget_bytes} B) is not offered where the device is the CPU: RAM is "
                "the one fast tier, under one budget (the device budget); the disk is the other"
            )

    @property
    def is_ram_tiered(self) -> bool:
        """Whether the plan is for a CPU: RAM and the disk, no host tier."""
        return self.layout is TierLayout.RAM_DISK

    @property
    def fallback_order(self) -> tuple[Tag, ...]:
        """The expert fallbacks this layout offers, cheapest in quality first (no cpu_execute on a CPU)."""
        return tuple(t for t in FALLBACK_ORDER if not (self.is_ram_tiered and t is Tag.CPU_EXECUTE))

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else max(1, self.context // 2)


@dataclasses.dataclass(slots=True)
class ClassPlan:
    """What one request class would need."""

    name: str
    tpot_slo_ms: float | None
    is_met_exactly: bool
    is_met: bool  # exactly, or with `fallback`
    fallback: str | None  # the first allowed fallback that meets the SLO (else the last tried; None: exact)
    predicted_tpot_ms: float  # with that fallback (exact when none)
    predicted_kl_per_token: float  # nats, its quality cost
    budget_mean_kl: float | None  # the class's budget, for comparison


@dataclasses.dataclass(slots=True)
class Plan:
    """The prediction."""

    fits: bool
    reason: str
    kv_bytes: int  # every request's KV blocks
    expert_slot_bytes: int  # what is left for experts
    num_expert_slots: int
    num_experts_total: int
    hit_rate: float  # expected fraction of (expert, request) uses served from device, reuse in a step included
    home: str  # where misses come from: host, disk, or a mix
    ttft_ms: float
    tpot_ms: float
    tokens_per_s: float
    classes: list[ClassPlan] = dataclasses.field(default_factory=list)
    tier_layout: str = TierLayout.DEVICE_HOST_DISK.value  # the tiers planned for
    tier_note: str = ""  # on a CPU: why no host tier and no cpu_execute are proposed

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _kv_bytes(shape: ModelShape, w: Workload) -> int:
    blocks = -(-w.context // w.block_size)
    block_bytes = w.block_size * shape.kv_bytes_per_token
    per_request = blocks * block_bytes * shape.num_layers
    gather = w.concurrency * blocks * block_bytes  # one layer's K/V gathered for attention
    return w.concurrency * per_request + gather


def _unique(shape: ModelShape, num_tokens: int) -> float:
    """Expected distinct experts a layer routes `num_tokens` tokens to (uniform routing)."""
    e, k = shape.num_experts, shape.top_k
    return e * (1.0 - (1.0 - min(1.0, k / e)) ** num_tokens)


def _miss_s(shape: ModelShape, profile: HardwareProfile, w: Workload, num_bytes: int, num_slots: int) -> float:
    """Seconds to bring one missed expert's `num_bytes` to the device from its home: the host cache holds
    as many of the experts not on device as its budget allows, the rest are read from the checkpoint. On a
    CPU the disk read lands in RAM, where the expert computes: one leg, no host-to-device copy."""
    if w.is_ram_tiered:
        return profile.transfer_s(num_bytes, Tier.DISK, Tier.HOST)
    off_device = max(1, shape.num_experts_total - num_slots)
    cached = off_device if w.host_budget_bytes is None else min(off_device, w.host_budget_bytes // shape.expert_bytes)
    host_frac = cached / off_device
    host_s, disk_s = profile.transfer_s(num_bytes, Tier.HOST), profile.transfer_s(num_bytes, Tier.DISK)
    return host_frac * host_s + (1 - host_frac) * disk_s


def _step_s(
    shape: ModelShape, profile: HardwareProfile, w: Workload, num_tokens: int, hit: float, tag: Tag | None, slots: int
) -> float:
    """One forward over `num_tokens` tokens at context `w.context`; misses served as `tag` (None: exact)."""
    attention = 4.0 * shape.num_heads * shape.head_dim * w.context * num_tokens * shape.num_layers
    dense = profile.dense_step_s(shape.num_layers, 2.0 * shape.num_dense_params * num_tokens + attention)
    unique = _unique(shape, num_tokens)
    per_expert = max(1, round(num_tokens * shape.top_k / max(unique, 1e-9)))
    call = profile.expert_s(per_expert, shape.expert_bytes, shape.num_params_per_expert, False, shape.dtype)
    misses = unique * (1.0 - hit)
    if num_tokens > w.concurrency:  # a prefill needing more distinct experts than there are slots misses the rest
        misses = max(misses, unique - slots / max(1, shape.num_moe_layers))
    hits = unique - misses
    if tag is None:
        miss = call + _miss_s(shape, profile, w, shape.expert_bytes, slots)
    elif tag is Tag.CPU_EXECUTE:
        miss = profile.expert_s(per_expert, shape.expert_bytes, shape.num_params_per_expert, True, shape.dtype)
    elif tag is Tag.EXPERT_LOWBIT:
        lowbit = int(shape.num_params_per_expert * (w.lowbit_bits / 8 + 8 / 32))  # codes + fp32 scale/zero per 32
        miss = call + _miss_s(shape, profile, w, lowbit, slots)
    else:  # expert_defer: the miss is skipped
        miss = 0.0
    engine = profile.step_overhead_s + w.concurrency * profile.request_overhead_s
    return engine + dense + shape.num_moe_layers * (hits * call + misses * miss)


def make_plan(
    shape: ModelShape,
    profile: HardwareProfile,
    w: Workload,
    classes: dict[str, dict[str, Any]] | None = None,
    cost: CostModel | None = None,
) -> Plan:
    """Predict fit, memory split, times and the fallbacks each class would need (see the module docstring)."""
    kv = _kv_bytes(shape, w)
    floor = shape.top_k * shape.expert_bytes
    total = shape.num_experts_total
    if w.device_budget_bytes is None:
        slots_bytes, fits, reason = total * shape.expert_bytes, True, "no device budget: everything fits"
    else:
        slots_bytes = w.device_budget_bytes - kv
        fits = slots_bytes >= floor
        reason = (
            f"{w.device_budget_bytes} B budget: {kv} B of KV for {w.concurrency} x {w.context} tokens, "
            f"{max(slots_bytes, 0)} B left for experts (the floor is {floor} B, top-{shape.top_k} experts)"
        )
    slots = max(0, min(total, slots_bytes // shape.expert_bytes))
    hit = (slots / total) ** w.routing_exponent if total else 1.0  # an expert is on device when a step starts
    picks = w.concurrency * shape.top_k  # (expert, request) uses per layer and decode step
    use_hit = 1.0 - _unique(shape, w.concurrency) * (1.0 - hit) / picks  # later uses in a step reuse a load
    tpot = _step_s(shape, profile, w, w.concurrency, hit, None, int(slots))
    prefill = w.concurrency * w.num_prompt_tokens  # every request's prompt, packed into prefill chunks
    chunks = -(-prefill // PREFILL_CHUNK)
    ttft = chunks * _step_s(shape, profile, w, min(prefill, PREFILL_CHUNK), hit, None, int(slots))
    home = "host" if w.host_budget_bytes is None or w.host_budget_bytes >= total * shape.expert_bytes else "host+disk"
    home = "disk" if w.is_ram_tiered else home
    plan = Plan(
        fits,
        reason,
        kv,
        max(0, slots_bytes),
        int(slots),
        total,
        use_hit,
        home,
        1e3 * ttft,
        1e3 * tpot,
        w.concurrency / tpot if tpot > 0 else 0.0,
        tier_layout=w.layout.value,
        tier_note=RAM_DISK_NOTE if w.is_ram_tiered else "",
    )
    cost = cost or CostModel(lowbit_bits=w.lowbit_bits)
    for name, spec in (classes or {}).items():
        plan.classes.append(_class_plan(name, spec, shape, profile, w, hit, tpot, cost, int(slots)))
    return plan


def _class_plan(
    name: str,
    spec: dict[str, Any],
    shape: ModelShape,
    profile: HardwareProfile,
    w: Workload,
    hit: float,
    tpot: float,
    cost: CostModel,
    plan_slots: int,
) -> ClassPlan:
    slo_ms = (spec.get("slo") or {}).get("tpot_ms")
    budget = spec.get("budget") or {}
    allowed = budget.get("allowed_tags")
    is_met = slo_ms is None or 1e3 * tpot <= slo_ms
    plan = ClassPlan(name, slo_ms, is_met, is_met, None, 1e3 * tpot, 0.0, budget.get("max_mean_kl"))
    if plan.is_met_exactly:
        return plan
    for tag in w.fallback_order:
        if tag.is_approximate and allowed is not None and tag.value not in allowed:
            continue
        tag_tpot = _step_s(shape, profile, w, w.concurrency, hit, tag, plan_slots)
        missed_per_token = shape.top_k * (1.0 - hit) * shape.num_moe_layers
        kl = missed_per_token * cost.expert_cost(tag, 0, 1.0 / shape.top_k) if tag.is_approximate else 0.0
        plan.fallback, plan.predicted_tpot_ms, plan.predicted_kl_per_token = tag.value, 1e3 * tag_tpot, kl
        plan.is_met = 1e3 * tag_tpot <= slo_ms
        if plan.is_met:
            return plan
    return plan

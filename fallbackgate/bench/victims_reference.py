"""The controllers' selections without their priority structures (issue 27): every call rebuilds and sorts
everything on device, every step walks every layer × block of every running request.

Kept as the reference that `tests/test_victim_order.py` checks the lazy selections against (same
victims, same order) and that :mod:`fallbackgate.bench.controller_cost` times them against. Nothing else
uses it.
"""

from __future__ import annotations

import heapq

from fallbackgate.controllers.base import Recency
from fallbackgate.controllers.joint import JointController
from fallbackgate.controllers.joint_memory import PREFETCH_MIN_FREQ
from fallbackgate.controllers.joint_placement import prefix_spill_mode
from fallbackgate.controllers.static_split import StaticSplitController
from fallbackgate.controllers.values import ValueModel
from fallbackgate.engine.controller import ControllerView, StepEndActions, Victim
from fallbackgate.engine.experts.store import ExpertKey
from fallbackgate.engine.kv.block import KVBlock
from fallbackgate.engine.kv.store import KVBlockKey, KVStore, SpillMode
from fallbackgate.engine.tags import ObjectKind, Tag


def joint_victims(
    joint: JointController, view: ControllerView, pinned_experts: set[ExpertKey], pinned_kv: set[KVBlockKey]
) -> list[Victim]:
    """`JointController.choose_victims` by full sorts: all device experts by urgency at the joint's current
    layer (ties by key), all KV blocks by value (one stable sort), merged by value per byte."""
    running = set(view.running_ids)
    experts = _experts_by_urgency(joint.values, view, pinned_experts, joint.current_layer)
    ranked_experts = [(joint.values.expert_value(k, view), Victim(expert_key=k)) for k in experts]
    ranked: list[tuple[float, Victim]] = []
    per_request: dict[str, tuple[SpillMode, float]] = {}
    quant_fraction = view.quantized_bytes(ObjectKind.KV_BLOCK, joint.kv_bits) / max(1, view.bytes_per_kv_block)
    for block in view.device_kv_blocks():
        if block.key in pinned_kv:
            continue
        rid = block.key[0]
        entry = view.prefix_entry(rid)
        if rid not in per_request and entry is not None:  # a kept prefix block
            per_request[rid] = (prefix_spill_mode(entry), joint.values.prefix_value(entry, view))
        if rid not in per_request:
            mode = joint.spill_mode(rid, view)
            fraction = 1.0 if mode is SpillMode.HOST_FULL else quant_fraction
            per_request[rid] = (mode, joint.values.kv_value(block.key, view, running, fraction))
        mode, value = per_request[rid]
        ranked.append((value, Victim(kv_block_key=block.key, spill_mode=mode)))
    ranked.sort(key=lambda item: item[0])
    return [v for _, v in heapq.merge(ranked_experts, ranked, key=lambda item: item[0])]


def _experts_by_urgency(
    values: ValueModel, view: ControllerView, pinned: set[ExpertKey], current_layer: int
) -> list[ExpertKey]:
    keys = [k for k in view.device_expert_keys() if k not in pinned]
    return sorted(keys, key=lambda k: (values.expert_urgency(k, view, current_layer), k))


def experts_lru_first(recency: Recency, view: ControllerView) -> list[ExpertKey]:
    on_device = view.device_expert_keys()
    known, resident = set(recency.experts), set(on_device)
    return [k for k in on_device if k not in known] + [k for k in recency.experts if k in resident]


def kv_lru_first(recency: Recency, view: ControllerView) -> list[KVBlockKey]:
    running = set(view.running_ids)
    order = {k: i for i, k in enumerate(recency.kv)}
    blocks = sorted(
        view.device_kv_blocks(), key=lambda b: (b.key[0] in running, order.get(b.key, -1), b.key[2], b.key[1])
    )
    return [b.key for b in blocks]


def take_victims(candidates: list[Victim], pinned_experts: set[ExpertKey], pinned_kv: set[KVBlockKey]) -> list[Victim]:
    return [
        v
        for v in candidates
        if (v.expert_key is not None and v.expert_key not in pinned_experts)
        or (v.kv_block_key is not None and v.kv_block_key not in pinned_kv)
    ]


def exact_lru_victims(
    recency: Recency, spill_mode: SpillMode, view: ControllerView, pinned_e: set, pinned_kv: set
) -> list[Victim]:
    """`ExactLRUController.choose_victims` before."""
    experts = [Victim(expert_key=k) for k in experts_lru_first(recency, view)]
    blocks = [Victim(kv_block_key=k, spill_mode=spill_mode) for k in kv_lru_first(recency, view)]
    return take_victims(experts + blocks, pinned_e, pinned_kv)


def independent_lru_victims(recency: Recency, view: ControllerView, pinned_e: set, pinned_kv: set) -> list[Victim]:
    """`IndependentLRUController.choose_victims` before."""
    ordered = [Victim(kv_block_key=k, spill_mode=SpillMode.HOST_FULL) for k in kv_lru_first(recency, view)]
    ordered += [Victim(expert_key=k) for k in experts_lru_first(recency, view)]
    return take_victims(ordered, pinned_e, pinned_kv)


def static_split_victims(
    split: StaticSplitController, view: ControllerView, pinned_e: set, pinned_kv: set
) -> list[Victim]:
    """`StaticSplitController.choose_victims` before."""
    expert_share, kv_share = split._shares(view)
    experts = [k for k in experts_lru_first(split.recency, view) if k not in pinned_e]
    blocks = [k for k in kv_lru_first(split.recency, view) if k not in pinned_kv]
    per_expert, per_block = view.bytes_per_expert, view.bytes_per_kv_block
    over_e = max(0, -(-(view.device_used_bytes(ObjectKind.EXPERT) - expert_share) // per_expert))
    over_kv = max(0, -(-(view.device_used_bytes(ObjectKind.KV_BLOCK) - kv_share) // per_block))
    ordered = [Victim(expert_key=k) for k in experts[:over_e]]
    ordered += [split.kv_victim(k) for k in blocks[:over_kv]]
    ordered += [Victim(expert_key=k) for k in experts[over_e:]]
    ordered += [split.kv_victim(k) for k in blocks[over_kv:]]
    return take_victims(ordered, pinned_e, pinned_kv)


def rebalance(view: ControllerView, values: ValueModel, slack_s: float, top_k: int) -> StepEndActions:
    """`joint_memory.rebalance` with the evictable experts sorted in full (by urgency at the step's start)."""
    actions = StepEndActions()
    per_expert, per_block = view.bytes_per_expert, view.bytes_per_kv_block
    free = view.device_free_bytes
    kv_cap = view.device_budget_bytes - max(1, top_k) * per_expert
    kv_used = view.device_used_bytes(ObjectKind.KV_BLOCK)
    running = set(view.running_ids)
    evictable = _experts_by_urgency(values, view, set(), -1)
    for key in dict.fromkeys(view.used_kv_block_keys):
        staged = view.staged_kv_tag(key)
        if staged is None or staged is Tag.KV_DEQUANT or key[0] not in running:
            continue
        if kv_used + per_block > kv_cap:
            break
        value = values.kv_value(key, view, running)
        while free < per_block and evictable and values.expert_value(evictable[0], view) < value:
            actions.evict_experts.append(evictable.pop(0))
            free += per_expert
        if free < per_block:
            break
        actions.promote_kv.append(key)
        free -= per_block
        kv_used += per_block
    for key in dict.fromkeys(view.deferred_expert_keys):
        seconds = view.profile.transfer_s(per_expert, view.expert_home(key))
        if values.frequency(key) < PREFETCH_MIN_FREQ or seconds > slack_s or view.is_expert_on_device(key):
            continue
        if free < per_expert:
            break
        actions.load_experts.append(key)
        free -= per_expert
        slack_s -= seconds
    return actions


def off_device_walk(kv: KVStore, request_id: str, num_blocks: int) -> list[KVBlock]:
    """The runner's per-step walk before: every layer × block of the request, keeping those off device."""
    return [
        block
        for layer in range(kv.num_layers)
        for block in kv.blocks(request_id, layer)[:num_blocks]
        if block.device is None
    ]


def block_keys(kv: KVStore, request_ids: list[str]) -> set[KVBlockKey]:
    """`KVStore.block_keys` before: a set of every key of every block of the requests (the step's pin)."""
    tables = kv.tables
    return {b.key for rid in request_ids if rid in tables for blocks in tables[rid] for b in blocks}


def decay_walk(freq: dict[ExpertKey, float], decay: float, used: set[ExpertKey]) -> None:
    """`ValueModel.update` before (frequencies kept as plain floats): every frequency decayed each step."""
    for key in list(freq):
        freq[key] *= decay
        if freq[key] < 1e-6 and key not in used:
            del freq[key]
    for key in used:
        freq[key] = freq.get(key, 0.0) + (1.0 - decay)


def joint_expert_victims(values: ValueModel, view: ControllerView, pinned: set[ExpertKey], k: int) -> list[ExpertKey]:
    """The expert half of `JointController.choose_victims` at a step's start by a full sort: every device
    expert valued on every call, then the `k` first taken."""
    return _experts_by_urgency(values, view, pinned, -1)[:k]


def copies_walk(entries: dict) -> list[tuple[ExpertKey, int]]:
    """`CopyVerifier._copies` before: a walk of every expert entry each step ((key, 0 device / 1 host))."""
    out = []
    for key, entry in entries.items():
        if entry.device is not None:
            out.append((key, 0))
        if entry.host is not None:
            out.append((key, 1))
    return out

"""Step-boundary rebalancing of the joint controller: move device bytes to the side worth more per byte.

KV blocks read exactly this step (staged) are promoted into device slots when their value per byte beats
the least valuable resident experts, which are evicted to make room; experts deferred this step are
prefetched into free room when they are hot and the step left link time unused. The KV side never takes
the last `top_k` expert slots, so an expert load can always make room.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fallbackgate.engine.controller import EngineView, StepEndActions
from fallbackgate.engine.tags import ObjectKind, Tag, Tier

if TYPE_CHECKING:
    from fallbackgate.controllers.joint import JointController

PREFETCH_MIN_FREQ = 0.3  # decayed use frequency an expert needs before it is prefetched


def rebalance(ctrl: JointController, view: EngineView) -> StepEndActions:
    """The step-end actions: promotions (evicting cheaper experts) and prefetches."""
    actions = StepEndActions()
    store, kv = view.expert_store, view.kv_store
    pool = store.device_pool
    free = pool.free_bytes
    kv_cap = pool.budget_bytes - max(1, ctrl.top_k) * store.bytes_per_expert
    kv_used = pool.used_bytes_by_kind[ObjectKind.KV_BLOCK]
    running = set(view.running_ids)
    evictable = sorted(store.device_keys(), key=lambda k: ctrl.values.expert_value(k, view))
    for key in dict.fromkeys(view.used_kv_block_keys):
        staged = kv.scratch.get(key)
        if staged is None or staged.tag is Tag.KV_DEQUANT or key[0] not in running:
            continue
        if kv_used + kv.bytes_per_block > kv_cap:
            break
        value = ctrl.values.kv_value(key, view, running)
        while free < kv.bytes_per_block and evictable and ctrl.values.expert_value(evictable[0], view) < value:
            actions.evict_experts.append(evictable.pop(0))
            free += store.bytes_per_expert
        if free < kv.bytes_per_block:
            break
        actions.promote_kv.append(key)
        free -= kv.bytes_per_block
        kv_used += kv.bytes_per_block
    slack = ctrl.link.left_s.get(Tier.HOST, 0.0)
    for key in dict.fromkeys(view.deferred_expert_keys):
        seconds = view.profile.transfer_s(store.bytes_per_expert, store.home(key))
        if ctrl.values.freq.get(key, 0.0) < PREFETCH_MIN_FREQ or seconds > slack or store.is_on_device(key):
            continue
        if free < store.bytes_per_expert:
            break
        actions.load_experts.append(key)
        free -= store.bytes_per_expert
        slack -= seconds
    return actions

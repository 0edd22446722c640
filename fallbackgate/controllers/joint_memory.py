"""Step-boundary rebalancing of the joint controller: move device bytes to the side worth more per byte.

KV blocks read exactly this step (staged) are promoted into device slots when their value per byte beats
the least valuable resident experts, which are evicted to make room; experts deferred this step are
prefetched into free room when they are hot and the step left link time unused. The KV side never takes
the last `top_k` expert slots, so an expert load can always make room.
"""

from __future__ import annotations

from fallbackgate.controllers.expert_rank import ExpertRanking
from fallbackgate.controllers.values import ValueModel
from fallbackgate.engine.controller import ControllerView, StepEndActions
from fallbackgate.engine.tags import ObjectKind, Tag

PREFETCH_MIN_FREQ = 0.3  # decayed use frequency an expert needs before it is prefetched


def rebalance(
    view: ControllerView, values: ValueModel, slack_s: float, top_k: int, ranking: ExpertRanking | None = None
) -> StepEndActions:
    """The step-end actions: promotions (evicting cheaper experts) and prefetches into the `slack_s` of host
    link time the step left unused. Experts are read lazily off `ranking` (synced by the caller; a fresh
    one, built here, when none is given), least valuable first, only as far as promotions need room."""
    actions = StepEndActions()
    per_expert, per_block = view.bytes_per_expert, view.bytes_per_kv_block
    free = view.device_free_bytes
    kv_cap = view.device_budget_bytes - max(1, top_k) * per_expert
    kv_used = view.device_used_bytes(ObjectKind.KV_BLOCK)
    running = set(view.running_ids)
    if ranking is None:
        ranking = ExpertRanking()
        ranking.sync(view, values)
    evictable = ranking.victims(view, values)
    cheapest = next(evictable, None)
    for key in dict.fromkeys(view.used_kv_block_keys):
        staged = view.staged_kv_tag(key)
        if staged is None or staged is Tag.KV_DEQUANT or key[0] not in running:
            continue
        if kv_used + per_block > kv_cap:
            break
        value = values.kv_value(key, view, running)
        while free < per_block and cheapest is not None and cheapest[0] < value:
            actions.evict_experts.append(cheapest[1])
            free += per_expert
            cheapest = next(evictable, None)
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

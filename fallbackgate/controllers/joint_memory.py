"""Step-boundary rebalancing of the joint controller: move device bytes to the side worth more per byte.

KV blocks read exactly this step (staged) are promoted into device slots when their value per byte beats
the least valuable resident experts, which are evicted to make room; experts deferred this step are
prefetched into free room when they are hot and the step left link time unused. The KV side never takes
the last `top_k` expert slots, so an expert load can always make room.

Room flows back the other way only here: an expert's placement inside a forward never takes KV room, so
without :func:`demotions` KV would keep every byte it once won (kept prefixes and idle requests included)
while the experts thrash in what is left. Demotion spills the KV blocks worth less per byte than the experts
the step used and no longer holds, one expert's room per such expert, most valuable expert first.
"""

from __future__ import annotations

from collections.abc import Iterator

from fallbackgate.controllers.expert_rank import ExpertRanking
from fallbackgate.controllers.values import ValueModel
from fallbackgate.engine.controller import ControllerView, StepEndActions, Victim
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
    evictable = ranking.victims(view, values)  # a generator: walked only once a promotion needs room
    cheapest = None
    for key in dict.fromkeys(view.used_kv_block_keys):
        staged = view.staged_kv_tag(key)
        if staged is None or staged is Tag.KV_DEQUANT or key[0] not in running:
            continue
        if kv_used + per_block > kv_cap:
            break
        value = values.kv_value(key, view, running)
        if free < per_block and cheapest is None:  # first asked (an exhausted walk answers None again)
            cheapest = next(evictable, None)
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


def demotions(
    view: ControllerView, values: ValueModel, kv_victims: Iterator[tuple[float, Victim]], actions: StepEndActions
) -> None:
    """Add to `actions` the spills that give the step's used-but-evicted experts their room back: for each
    such expert, most valuable first, the cheapest KV blocks (`kv_victims`, lowest value per byte first) while
    each is worth less per byte than that expert, until one expert's bytes are free (counting the free room
    and what `actions` already frees or takes)."""
    missed = [k for k in dict.fromkeys(view.used_expert_keys) if not view.is_expert_on_device(k)]
    if not missed:
        return
    per_expert, per_block = view.bytes_per_expert, view.bytes_per_kv_block
    promoted = set(actions.promote_kv)
    free = view.device_free_bytes + per_expert * len(actions.evict_experts) - per_block * len(promoted)
    free -= per_expert * len(actions.load_experts)
    ranked = sorted(((values.expert_value(k, view), k) for k in missed), key=lambda item: -item[0])
    victim = None if free >= per_expert * len(ranked) else next(kv_victims, None)  # walked only when needed
    for expert_value, _ in ranked:
        while free < per_expert and victim is not None and victim[0] < expert_value:
            key = victim[1].kv_block_key
            if key is not None and key not in promoted:
                actions.spill.append((key, victim[1].spill_mode))
                free += per_block
            victim = next(kv_victims, None)
        if free < per_expert:
            return
        free -= per_expert

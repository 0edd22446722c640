"""Between steps: carry out what the controller asks (spills, evictions, promotions, prefetches)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fallbackgate.engine.step_context import EventLog
from fallbackgate.engine.tags import ObjectKind, Tag

if TYPE_CHECKING:
    from fallbackgate.engine.engine import Engine

ENGINE_REQUEST_ID = "__engine__"  # events not caused by one request (prefetches)


def apply_step_end(engine: Engine, log: EventLog) -> None:
    """Run the controller's step-end actions within the budgets, then reset per-step state."""
    executor, kv, experts = engine.executor, engine.kv_store, engine.expert_store
    actions = engine.controller.on_step_end(engine.view())
    for key, mode in actions.spill:
        request_id, layer, index = key
        if request_id in kv.tables and index < len(kv.blocks(request_id, layer)):
            executor.spill_kv(key, mode)
    for key in actions.evict_experts:
        if experts.is_on_device(key):
            experts.evict(key)
    for key in actions.promote_kv:
        request_id, layer, index = key
        if request_id in kv.tables and index < len(kv.blocks(request_id, layer)):
            kv.promote(kv.blocks(request_id, layer)[index])
    for key in actions.load_experts:
        if experts.is_on_device(key) or not experts.device_pool.can_reserve(experts.bytes_per_expert):
            continue
        fetched = experts.place(key, is_async=True)
        log.add_transfer(
            engine.config.profile,
            ENGINE_REQUEST_ID,
            key[0],
            ObjectKind.EXPERT,
            Tag.EXACT_LOAD,
            fetched.bytes_moved,
            fetched.source_tier,
            note="prefetch after defer",
        )
    experts.settle_reads(log.step_id + 1)  # unused reads ahead join the host cache; their first use credits them
    kv.clear_scratch()
    executor.used_expert_keys.clear()
    executor.used_kv_block_keys.clear()
    executor.deferred_expert_keys.clear()

"""Memory pressure: making device room for KV blocks, and preempting a request (swap or drop)."""

from __future__ import annotations

from collections.abc import Callable, Container

from fallbackgate.engine.config import PreemptMode
from fallbackgate.engine.experts.executor import Executor
from fallbackgate.engine.kv.store import KVBlockKey, KVStore, SpillMode
from fallbackgate.engine.sequence import Sequence


def make_room_for_kv(
    executor: Executor,
    num_bytes: int,
    pinned: Container[KVBlockKey],
    is_done: Callable[[], bool],
    is_kv_only: bool,
) -> bool:
    """Free `num_bytes` of device room for KV: experts or KV as the controller chooses, then KV blocks only."""
    if not is_kv_only and executor.make_room(num_bytes, pinned_kv=pinned, is_done=is_done):
        return True  # experts or KV, as the controller chose
    all_experts = set(executor.expert_store.device_keys())  # only KV blocks can help now
    return executor.make_room(num_bytes, pinned_kv=pinned, pinned_experts=all_experts, is_done=is_done)


def preempt(mode: PreemptMode, kv_store: KVStore, executor: Executor, seq: Sequence) -> None:
    """Preempt `seq`: SWAP spills its device KV blocks to host in full; otherwise its KV is dropped and its
    computed tokens are to be recomputed."""
    if mode == PreemptMode.SWAP:
        for blocks in kv_store.tables[seq.request_id]:
            for block in blocks:
                if block.device is not None:
                    executor.spill_kv(block.key, SpillMode.HOST_FULL)
    else:
        kv_store.free_sequence(seq.request_id)
        kv_store.add_sequence(seq.request_id)
        seq.num_recompute_tokens = max(seq.num_recompute_tokens, seq.num_computed_tokens)
        seq.num_computed_tokens = 0

"""Expert-access traces and the offline optimum: Belady's MIN bounds how few expert loads any exact policy needs.

A trace is the sequence of ``(layer, expert_id)`` uses in the order the engine computed them (layer order
within a step, steps in order). :class:`TraceRecorder` wraps any controller and records the trace from
``ControllerView.used_expert_keys`` at every step end, delegating every decision to the wrapped controller.
:func:`belady_misses` counts the loads of the optimal demand-paging policy with ``num_slots`` expert
slots (evict the expert whose next use lies farthest in the future), starting from an empty device like
the engine does.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence
from typing import Any

from fallbackgate.engine.controller import (
    Controller,
    ControllerView,
    Decision,
    ExpertMiss,
    KVMiss,
    StepEndActions,
    Victim,
)
from fallbackgate.engine.experts.store import ExpertKey
from fallbackgate.engine.kv.store import KVBlockKey
from fallbackgate.engine.messages import StepPlan


def belady_misses(trace: Sequence[ExpertKey], num_slots: int | Sequence[int]) -> int:
    """Loads (misses) of Belady's MIN on ``trace`` with ``num_slots`` slots, cold start; O(n log n).

    ``num_slots`` may also give the slots at each access (a room that changes over the run, as a shared
    budget's expert share does): a miss then evicts the farthest next uses until the cache is below that
    access's slots (at least one slot is always there for the miss itself)."""
    n = len(trace)
    slots = [num_slots] * n if isinstance(num_slots, int) else list(num_slots)
    if len(slots) != n:
        raise ValueError(f"num_slots gives {len(slots)} rooms for {n} accesses")
    if any(s < 1 for s in slots):
        raise ValueError(f"num_slots must be >= 1, got {min(slots)}")
    next_use = [n] * n
    last: dict[ExpertKey, int] = {}
    for i in range(n - 1, -1, -1):
        next_use[i] = last.get(trace[i], n)
        last[trace[i]] = i
    cached: dict[ExpertKey, int] = {}  # key -> index of its next use
    heap: list[tuple[int, ExpertKey]] = []  # (-next use, key); stale entries skipped lazily
    misses = 0
    for i, key in enumerate(trace):
        if key not in cached:
            misses += 1
            while len(cached) >= slots[i]:
                neg, victim = heapq.heappop(heap)
                if cached.get(victim) == -neg:
                    del cached[victim]
        cached[key] = next_use[i]
        heapq.heappush(heap, (-next_use[i], key))
    return misses


def lru_misses(trace: Sequence[ExpertKey], num_slots: int) -> int:
    """Loads of plain LRU on ``trace`` with ``num_slots`` slots (cold start), for comparison."""
    if num_slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    cache: OrderedDict[ExpertKey, None] = OrderedDict()
    misses = 0
    for key in trace:
        if key in cache:
            cache.move_to_end(key)
            continue
        misses += 1
        if len(cache) >= num_slots:
            cache.popitem(last=False)
        cache[key] = None
    return misses


class TraceRecorder(Controller):
    """A controller that delegates everything to ``inner`` and records the expert-access trace."""

    def __init__(self, inner: Controller) -> None:
        self.inner = inner
        self.trace: list[ExpertKey] = []

    def expert_action(self, miss: ExpertMiss) -> Decision:
        return self.inner.expert_action(miss)

    def kv_action(self, miss: KVMiss) -> Decision:
        return self.inner.kv_action(miss)

    def choose_victims(
        self,
        num_bytes: int,
        view: ControllerView,
        pinned_experts: Container[ExpertKey],
        pinned_kv: Container[KVBlockKey],
    ) -> Iterable[Victim]:
        return self.inner.choose_victims(num_bytes, view, pinned_experts, pinned_kv)

    def on_step_start(self, plan: StepPlan, view: ControllerView) -> None:
        self.inner.on_step_start(plan, view)

    def choose_read_ahead(self, predicted: list[ExpertKey], view: ControllerView) -> list[ExpertKey]:
        return self.inner.choose_read_ahead(predicted, view)

    def on_step_end(self, view: ControllerView) -> StepEndActions:
        """Record the step's expert uses (in use order), then let the wrapped controller act."""
        self.trace.extend(view.used_expert_keys)
        return self.inner.on_step_end(view)

    def __getattr__(self, name: str) -> Any:  # slips, top_k, ... of the wrapped controller
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

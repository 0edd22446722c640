"""Device experts in least-recently-used order, kept between calls: a victim costs O(log n), not a walk.

The order is a binary heap of ``(last use, key)`` over the experts on device, where a use is numbered by a
counter the step-end touch advances (never-used experts carry -1, so they come first, in key order: the
expert store's order). It follows the store's residency journal (``view.expert_changes_since``): a key that
came on device gets an entry with its last use, one that left is dropped from the live map and its entry is
skipped when met. A touch gives each used device expert a new entry. Victims are read off the heap without
popping it (best-first over its implicit tree, O(k log k) for k victims), as
:class:`~fallbackgate.controllers.expert_rank.ExpertRanking` does for value order. A view without a journal
gets ``None`` from :meth:`ExpertRecency.lru_first` and the caller walks the view, as before.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator

from fallbackgate.engine.controller import ControllerView
from fallbackgate.engine.experts.store import ExpertKey

NEVER_USED = -1


class ExpertRecency:
    """The heap of device experts by last use and the journal cursor it follows (see the module docstring)."""

    def __init__(self) -> None:
        self.heap: list[tuple[int, ExpertKey]] = []
        self.live: dict[ExpertKey, int] = {}  # device key -> its last use (NEVER_USED: none)
        self.last_use: dict[ExpertKey, int] = {}  # every key ever used -> its last use
        self.clock = 0  # the next use number
        self.view: ControllerView | None = None  # the view the heap follows (another view: rebuild)
        self.cursor = -1  # into the view's residency journal (-1: rebuild)
        self.num_rebuilds = 0

    def touch(self, keys: Iterable[ExpertKey]) -> None:
        """Record a use of each key, in order (later keys are more recent)."""
        last_use, live, heap = self.last_use, self.live, self.heap
        for key in keys:
            stamp = last_use[key] = self.clock
            self.clock += 1
            if key in live:
                live[key] = stamp
                heapq.heappush(heap, (stamp, key))
        if len(heap) > 2 * len(live) + 64:  # stale entries outnumber live ones: compact
            self._heapify()

    def lru_first(self, view: ControllerView) -> Iterator[ExpertKey] | None:
        """Device experts least recently used first, lazily; None when the view keeps no journal."""
        if not self._sync(view):
            return None
        return self._walk()

    def _sync(self, view: ControllerView) -> bool:
        changed, cursor = view.expert_changes_since(self.cursor if view is self.view else -1)
        if cursor < 0:
            return False
        self.cursor = cursor
        if changed is None or view is not self.view:
            self.view = view
            self.live = {key: self.last_use.get(key, NEVER_USED) for key in view.device_expert_keys()}
            self._heapify()
            self.num_rebuilds += 1
            return True
        live, heap, last_use = self.live, self.heap, self.last_use
        for key in dict.fromkeys(changed):
            if not view.is_expert_on_device(key):
                live.pop(key, None)
            elif key not in live:
                stamp = live[key] = last_use.get(key, NEVER_USED)
                heapq.heappush(heap, (stamp, key))
        return True

    def _heapify(self) -> None:
        self.heap = [(stamp, key) for key, stamp in self.live.items()]
        heapq.heapify(self.heap)

    def _walk(self) -> Iterator[ExpertKey]:
        """The live entries in heap order (the heap must not change while the walk is read)."""
        heap, live, seen = self.heap, self.live, set()
        frontier = [(heap[0], 0)] if heap else []
        while frontier:
            (stamp, key), i = heapq.heappop(frontier)
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child], child))
            if live.get(key) == stamp and key not in seen:  # a key that left and came back has two entries
                seen.add(key)
                yield key

"""Device experts in victim order, kept between calls: a victim costs O(G + log n), not a rebuild.

The order is :meth:`~fallbackgate.controllers.values.ValueModel.expert_urgency`: value per byte divided by
how soon the expert's layer runs again, so the layer just computed gives up its cold experts before the
next layer's (a walk over the layers whose experts do not fit otherwise degenerates into LRU). Within one
group of experts — one layer, one home tier — that order follows the frequency alone, so the ranking keeps a
binary heap of ``(scaled frequency, key)`` per group and merges the G groups' heads at each call, valued
for the layer the step is at.

The heaps are maintained from two change logs: the expert store's residency journal (a copy came or went,
so residency or home tier changed; read through ``view.expert_changes_since``) and the value model's
frequency log (a use, a prune). Frequencies are kept scaled (:class:`~fallbackgate.controllers.values.
ValueModel`), so the step-end decay moves nothing. Entries are refreshed lazily: a changed key gets a new
entry, the old one is skipped when met. Victims are read off the heaps without popping them (best-first
over each implicit tree), so one set of heaps serves every miss of a step. A view without a journal (a
static or replayed view) gets a rebuild per call. Ties go by key.
"""

from __future__ import annotations

import heapq
from collections.abc import Container, Iterator

from fallbackgate.controllers.values import ValueModel
from fallbackgate.engine.controller import ControllerView
from fallbackgate.engine.experts.store import ExpertKey
from fallbackgate.engine.tags import Tier

Group = tuple[int, Tier]  # (layer, home tier)
Entry = tuple[float, ExpertKey]  # (scaled frequency, key)


class ExpertRanking:
    """The per-group heaps of device experts and the cursors into the logs they follow (see the module
    docstring)."""

    def __init__(self) -> None:
        self.heaps: dict[Group, list[Entry]] = {}
        self.live: dict[ExpertKey, float] = {}  # device key -> its scaled frequency
        self.groups: dict[ExpertKey, Group] = {}  # device key -> its group
        self.num_entries = 0  # entries in all heaps, stale ones included
        self.view: ControllerView | None = None  # the view the heaps follow (another view: rebuild)
        self.cursor = -1  # into the view's residency journal (-1: rebuild)
        self.values_cursor = -1  # into the value model's frequency log
        self.values_epoch = -1  # the value model's renormalizations seen
        self.num_rebuilds = 0

    def sync(self, view: ControllerView, values: ValueModel) -> None:
        """Bring the heaps up to date with what changed since the last call (a rebuild when it cannot)."""
        changed, self.cursor = view.expert_changes_since(self.cursor if view is self.view else -1)
        freq_changed, self.values_cursor = values.changes_since(self.values_cursor)
        if changed is None or freq_changed is None or values.epoch != self.values_epoch or view is not self.view:
            self._rebuild(view, values)
            return
        scaled, groups = values.scaled, self.groups
        for key in dict.fromkeys(changed):  # residency or home changed: ask the view
            if not view.is_expert_on_device(key):
                self.live.pop(key, None)
                groups.pop(key, None)
                continue
            group = (key[0], view.expert_home(key))
            if groups.get(key) != group:
                groups[key] = group
                self.live.pop(key, None)  # a new group needs a new entry whatever the frequency
            self._push(key, scaled.get(key, 0.0))
        for key in dict.fromkeys(freq_changed):  # only a frequency changed: residency and home are known
            if key in groups:
                self._push(key, scaled.get(key, 0.0))
        if self.num_entries > 2 * len(self.live) + 8:  # stale entries outnumber live ones: compact (a walk pops them)
            self._heapify()

    def _push(self, key: ExpertKey, order: float) -> None:
        if self.live.get(key) != order:
            self.live[key] = order
            heapq.heappush(self.heaps.setdefault(self.groups[key], []), (order, key))
            self.num_entries += 1

    def _rebuild(self, view: ControllerView, values: ValueModel) -> None:
        """Every device expert from a walk."""
        self.view, self.values_epoch = view, values.epoch
        keys = view.device_expert_keys()
        self.groups = {key: (key[0], view.expert_home(key)) for key in keys}
        self.live = {key: values.scaled_freq(key) for key in keys}
        self._heapify()
        self.num_rebuilds += 1

    def _heapify(self) -> None:
        self.heaps = {}
        for key, order in self.live.items():
            self.heaps.setdefault(self.groups[key], []).append((order, key))
        for heap in self.heaps.values():
            heapq.heapify(heap)
        self.num_entries = len(self.live)

    def victims(
        self,
        view: ControllerView,
        values: ValueModel,
        pinned: Container[ExpertKey] = (),
        current_layer: int = -1,
    ) -> Iterator[tuple[float, ExpertKey]]:
        """Device experts not pinned, lowest urgency at `current_layer` first (ties by key), as (value per
        byte, key): the value (``ValueModel.expert_value``) is what other kinds of object compare against.
        Produced lazily from the heaps as they stand (sync first; they must not change while this is read)."""
        streams = []
        for group, heap in self.heaps.items():
            walk = self._walk(group, heap, pinned)
            streams.append((values.expert_urgency(key, view, current_layer), key) for key in walk)
        for _, key in heapq.merge(*streams):
            yield values.expert_value(key, view), key

    def _walk(self, group: Group, heap: list[Entry], pinned: Container[ExpertKey]) -> Iterator[ExpertKey]:
        """One group's live, unpinned keys in heap order (lowest frequency first, ties by key)."""
        live, groups, seen = self.live, self.groups, set()
        frontier = [(heap[0], 0)] if heap else []
        while frontier:
            (order, key), i = heapq.heappop(frontier)
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child], child))
            if live.get(key) != order or groups.get(key) != group or key in seen or key in pinned:
                continue
            seen.add(key)
            yield key

"""Device experts ranked by value per byte, kept between calls: a victim costs O(log n), not a rebuild.

The ranking is a binary heap of ``(order value, tie, key)`` over the experts on device, maintained from two
change logs: the expert store's residency journal (a copy came or went, so residency or home tier changed;
read through ``view.expert_changes_since``) and the value model's frequency log (a use, a prune). An
expert's order value is its value per byte without the decay every frequency shares
(:class:`~fallbackgate.controllers.values.ValueModel` keeps frequencies scaled), so the step-end decay moves
nothing. Entries are refreshed lazily: a changed key gets a new entry, the old one is skipped when met.

Victims are read off the heap without popping it (best-first over its implicit tree, O(k log k) for k
victims), so one heap serves every miss of a step. A view without a journal (a static or replayed view)
gets a rebuild per call, ties in the view's order, as before.
"""

from __future__ import annotations

import heapq
from collections.abc import Container, Iterator

from fallbackgate.controllers.values import ValueModel
from fallbackgate.engine.controller import ControllerView
from fallbackgate.engine.experts.store import ExpertKey
from fallbackgate.engine.tags import Tier

Entry = tuple[float, object, ExpertKey]  # (order value, tie-break, key)


class ExpertRanking:
    """The heap of device experts and the cursors into the logs it follows (see the module docstring)."""

    def __init__(self) -> None:
        self.heap: list[Entry] = []
        self.live: dict[ExpertKey, float] = {}  # device key -> its current order value
        self.homes: dict[ExpertKey, Tier] = {}  # device key -> its home tier (journaled views)
        self.seconds: dict[Tier, float] = {}  # one expert's load time from each home tier
        self.view: ControllerView | None = None  # the view the heap follows (another view: rebuild)
        self.cursor = -1  # into the view's residency journal (-1: rebuild)
        self.values_cursor = -1  # into the value model's frequency log
        self.values_epoch = -1  # the value model's renormalizations seen
        self.num_rebuilds = 0

    def sync(self, view: ControllerView, values: ValueModel) -> None:
        """Bring the heap up to date with what changed since the last call (a rebuild when it cannot)."""
        changed, self.cursor = view.expert_changes_since(self.cursor if view is self.view else -1)
        freq_changed, self.values_cursor = values.changes_since(self.values_cursor)
        if changed is None or freq_changed is None or values.epoch != self.values_epoch or view is not self.view:
            self._rebuild(view, values, is_journaled=self.cursor >= 0)  # a cursor < 0: the view keeps no journal
            return
        seconds, live, homes, heap = self.seconds, self.live, self.homes, self.heap
        num_bytes, scaled = view.bytes_per_expert, values.scaled
        for key in dict.fromkeys(changed):  # residency or home changed: ask the view
            if not view.is_expert_on_device(key):
                live.pop(key, None)
                homes.pop(key, None)
                continue
            home = homes[key] = view.expert_home(key)
            self._push(key, self._order(key, home, view, values))
        for key in dict.fromkeys(freq_changed):  # only a frequency changed: residency and home are known
            home = homes.get(key)
            if home is not None:
                freq = scaled.get(key, 0.0)
                order = freq * seconds[home] / num_bytes if freq else 0.0
                if live[key] != order:
                    live[key] = order
                    heapq.heappush(heap, (order, key, key))
        if len(self.heap) > 2 * len(self.live) + 64:  # stale entries outnumber live ones: compact
            self.heap = [(order, key, key) for key, order in self.live.items()]
            heapq.heapify(self.heap)

    def _push(self, key: ExpertKey, order: float) -> None:
        if self.live.get(key) != order:
            self.live[key] = order
            heapq.heappush(self.heap, (order, key, key))

    def _rebuild(self, view: ControllerView, values: ValueModel, is_journaled: bool) -> None:
        """Every device expert from a walk; ties by key where a journal keeps the heap (the store's order),
        else by the view's order."""
        self.view, self.values_epoch = view, values.epoch
        self.seconds = {}
        keys = view.device_expert_keys()
        if is_journaled:  # order values free of the shared decay (the heap outlives this step)
            self.homes = {key: view.expert_home(key) for key in keys}
            self.live = {key: self._order(key, home, view, values) for key, home in self.homes.items()}
        else:  # rebuilt per call: the values themselves, as the full sort had them
            self.live = dict(values.expert_values(keys, view))
        self.heap = [(order, key if is_journaled else i, key) for i, (key, order) in enumerate(self.live.items())]
        heapq.heapify(self.heap)
        self.num_rebuilds += 1

    def _order(self, key: ExpertKey, home: Tier, view: ControllerView, values: ValueModel) -> float:
        """`key`'s order value: its value per byte without the shared decay (the formula the sync repeats)."""
        if home not in self.seconds:
            self.seconds[home] = view.profile.transfer_s(view.bytes_per_expert, home)
        scaled = values.scaled_freq(key)
        return scaled * self.seconds[home] / view.bytes_per_expert if scaled else 0.0

    def victims(
        self, view: ControllerView, values: ValueModel, pinned: Container[ExpertKey] = ()
    ) -> Iterator[tuple[float, ExpertKey]]:
        """Device experts not pinned, lowest value first, as (value per byte, key), produced lazily from the
        heap as it stands (sync first; the heap must not change while the walk is read)."""
        heap, live, seen = self.heap, self.live, set()
        frontier = [(heap[0], 0)] if heap else []
        while frontier:
            (order, _, key), i = heapq.heappop(frontier)
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child], child))
            if live.get(key) != order or key in seen or key in pinned:
                continue
            seen.add(key)
            yield values.expert_value(key, view), key

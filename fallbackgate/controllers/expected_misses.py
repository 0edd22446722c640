"""The joint controller's expected load time of the next step's misses, kept between steps.

``Σ min(1, frequency) × load time`` over the remembered experts that are not on device (what a strict request
must keep link time for). A walk of every remembered frequency costs O(layers × experts) per step; here each
non-resident key keeps its share in a per-home-tier sum of scaled frequencies (the value model keeps them
divided by the decay every frequency shares, so the step's decay moves nothing), patched from the expert
store's residency journal (a copy came or went: residency or home changed) and the value model's frequency log
(a use, a prune): the work per step follows what changed. Frequencies above 1 (a seeded state) are clipped
exactly from the few keys that have them. A view without a journal, a renormalization or a log that no
longer reaches back rebuilds from one walk, and so does every ``REBUILD_EVERY``-th sync (the sums' rounding).
"""

from __future__ import annotations

from collections.abc import Callable

from fallbackgate.controllers.values import ValueModel
from fallbackgate.engine.controller import ControllerView
from fallbackgate.engine.experts.store import ExpertKey
from fallbackgate.engine.tags import Tier

REBUILD_EVERY = 256  # syncs between rebuilds that reset the sums' accumulated rounding


class ExpectedMisses:
    """Per-home sums of the scaled frequencies of remembered experts not on device (see the module docstring)."""

    def __init__(self) -> None:
        self.parts: dict[ExpertKey, tuple[Tier, float]] = {}  # non-resident remembered key -> (home, scaled)
        self.sums: dict[Tier, float] = {}  # home tier -> Σ scaled frequency of its non-resident keys
        self.over: set[ExpertKey] = set()  # keys whose frequency was above 1 when last patched
        self.view: ControllerView | None = None
        self.cursor = -1  # into the view's residency journal
        self.values_cursor = -1  # into the value model's frequency log
        self.values_epoch = -1
        self.num_syncs = 0
        self.num_rebuilds = 0

    def seconds(self, view: ControllerView, values: ValueModel, load_s: Callable[[Tier], float]) -> float:
        """Expected seconds of link the next step's misses take; `load_s(home)`: one expert's load time."""
        self._sync(view, values)
        scale, loads = values.scale, {home: load_s(home) for home in self.sums}
        total = sum(loads[home] * scale * part for home, part in self.sums.items())
        for key in list(self.over):  # clip: min(1, frequency)
            home, scaled = self.parts.get(key, (None, 0.0))
            if home is None or scaled * scale <= 1.0:
                self.over.discard(key)  # gone, resident, or decayed to 1 or below (frequencies only decay)
            else:
                total -= loads[home] * (scaled * scale - 1.0)
        return total

    def _sync(self, view: ControllerView, values: ValueModel) -> None:
        changed, self.cursor = view.expert_changes_since(self.cursor if view is self.view else -1)
        freq_changed, self.values_cursor = values.changes_since(self.values_cursor)
        self.num_syncs += 1
        if (
            changed is None
            or freq_changed is None
            or values.epoch != self.values_epoch
            or view is not self.view
            or self.num_syncs % REBUILD_EVERY == 0
        ):
            self._rebuild(view, values)
            return
        for key in dict.fromkeys(changed):  # residency or home changed
            self._patch(key, view, values, view.expert_home(key))
        for key in dict.fromkeys(freq_changed):  # only the frequency changed: a kept share knows its home
            part = self.parts.get(key)
            self._patch(key, view, values, part[0] if part is not None else view.expert_home(key))

    def _patch(self, key: ExpertKey, view: ControllerView, values: ValueModel, home: Tier) -> None:
        """Replace `key`'s share with its current one: none when on device or forgotten."""
        old = self.parts.pop(key, None)
        if old is not None:
            self.sums[old[0]] -= old[1]
        scaled = values.scaled.get(key, 0.0)
        if not scaled or view.is_expert_on_device(key):
            return
        self.parts[key] = (home, scaled)
        self.sums[home] = self.sums.get(home, 0.0) + scaled
        if scaled * values.scale > 1.0:
            self.over.add(key)

    def _rebuild(self, view: ControllerView, values: ValueModel) -> None:
        self.view, self.values_epoch = view, values.epoch
        self.parts, self.sums, self.over = {}, {}, set()
        self.num_rebuilds += 1
        for key in list(values.scaled):
            if not view.is_expert_on_device(key):
                self._patch(key, view, values, view.expert_home(key))

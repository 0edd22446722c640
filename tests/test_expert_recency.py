"""The LRU controllers' expert order kept from the residency journal equals the walk over the view."""

from __future__ import annotations

import itertools
import random

from fallbackgate.controllers.base import Recency
from fallbackgate.engine.experts.journal import ChangeLog


class JournaledView:
    """The four expert queries the recency order reads, over a dict of device flags and a change log."""

    def __init__(self, keys: list[tuple[int, int]], journaled: bool = True) -> None:
        self.on_device = dict.fromkeys(sorted(keys), False)
        self.journal: ChangeLog = ChangeLog()
        self.journaled = journaled
        self.used_expert_keys: tuple = ()

    def set(self, key: tuple[int, int], is_on: bool) -> None:
        self.on_device[key] = is_on
        self.journal.record(key)

    def device_expert_keys(self) -> tuple:
        return tuple(k for k, is_on in self.on_device.items() if is_on)

    def is_expert_on_device(self, key: tuple[int, int]) -> bool:
        return self.on_device[key]

    def expert_changes_since(self, cursor: int):
        return self.journal.since(cursor) if self.journaled else (None, -1)

    used_kv_block_keys: tuple = ()


def test_the_journaled_lru_order_equals_the_walk_through_loads_evictions_and_uses() -> None:
    rng = random.Random(0)
    keys = [(layer, e) for layer in range(4) for e in range(16)]
    fast, slow = JournaledView(keys), JournaledView(keys, journaled=False)
    fast_recency, slow_recency = Recency(), Recency()
    num_compared = 0
    for step in range(300):
        for _ in range(rng.randrange(6)):  # loads and evictions, as the engine's misses make them
            key = rng.choice(keys)
            is_on = rng.random() < 0.6
            fast.set(key, is_on)
            slow.set(key, is_on)
        used = tuple(rng.choice(keys) for _ in range(rng.randrange(8)))  # duplicates and off-device keys too
        fast.used_expert_keys = slow.used_expert_keys = used
        fast_recency.touch(fast)
        slow_recency.touch(slow)
        k = rng.choice([1, 3, 1000])
        got = list(itertools.islice(fast_recency.experts_lru_first(fast), k))
        want = list(itertools.islice(slow_recency.experts_lru_first(slow), k))
        assert got == want, f"step {step}"
        num_compared += len(want)
    assert fast_recency._expert_order.num_rebuilds == 1  # one walk at the start, then the journal only
    assert num_compared > 1000


def test_a_view_without_a_journal_is_walked() -> None:
    view = JournaledView([(0, 0), (0, 1)], journaled=False)
    view.set((0, 1), True)
    recency = Recency()
    assert list(recency.experts_lru_first(view)) == [(0, 1)]
    assert recency._expert_order.num_rebuilds == 0

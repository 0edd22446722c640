"""The joint controller's expected miss time kept from the journals equals the walk of every frequency."""

from __future__ import annotations

import random

import pytest

from fallbackgate.controllers import expected_misses as em
from fallbackgate.controllers.expected_misses import ExpectedMisses
from fallbackgate.controllers.values import ValueModel
from fallbackgate.engine.experts.journal import ChangeLog
from fallbackgate.engine.tags import Tier

LOAD_S = {Tier.HOST: 0.002, Tier.DISK: 0.011}


class JournaledView:
    """Residency and home tier per expert, with the store's change log (a copy came or went)."""

    def __init__(self, keys: list[tuple[int, int]]) -> None:
        self.on_device = dict.fromkeys(keys, False)
        self.home = dict.fromkeys(keys, Tier.DISK)
        self.journal: ChangeLog = ChangeLog()
        self.used_expert_keys: tuple = ()
        self.deferred_expert_keys: tuple = ()

    def set(self, key: tuple[int, int], is_on: bool, home: Tier) -> None:
        self.on_device[key], self.home[key] = is_on, home
        self.journal.record(key)

    def is_expert_on_device(self, key: tuple[int, int]) -> bool:
        return self.on_device[key]

    def expert_home(self, key: tuple[int, int]) -> Tier:
        return self.home[key]

    def expert_changes_since(self, cursor: int):
        return self.journal.since(cursor)


def walk(view: JournaledView, values: ValueModel) -> float:
    """What the joint controller summed before: every remembered expert not on device."""
    missing = [(k, f) for k, f in values.frequencies() if not view.is_expert_on_device(k)]
    return sum(min(1.0, f) * LOAD_S[view.expert_home(k)] for k, f in missing)


@pytest.mark.parametrize("decay", [0.9, 0.5])
def test_kept_sums_equal_the_walk_through_uses_loads_evictions_home_changes_and_prunes(decay: float) -> None:
    rng = random.Random(1)
    keys = [(layer, e) for layer in range(4) for e in range(24)]
    view, values, kept = JournaledView(keys), ValueModel(decay), ExpectedMisses()
    values.set_frequencies({keys[0]: 3.0, keys[1]: 1.5})  # seeded above 1: clipped to 1 while they last
    num_nonzero = 0
    for step in range(400):
        for _ in range(rng.randrange(8)):  # misses load, room evicts, a host cache comes and goes
            view.set(rng.choice(keys), rng.random() < 0.5, rng.choice([Tier.HOST, Tier.DISK]))
        view.used_expert_keys = tuple(rng.choice(keys[: 8 + step % 40]) for _ in range(rng.randrange(10)))
        view.deferred_expert_keys = tuple(rng.choice(keys) for _ in range(rng.randrange(2)))
        values.update(view)
        want = walk(view, values)
        assert kept.seconds(view, values, LOAD_S.__getitem__) == pytest.approx(want, rel=1e-9, abs=1e-15), step
        num_nonzero += want > 0
    assert num_nonzero > 300
    assert kept.num_rebuilds <= 1 + 400 // em.REBUILD_EVERY + values.epoch  # the first walk, the periodic resets


def test_a_forgotten_or_loaded_expert_leaves_the_sum() -> None:
    keys = [(0, 0), (0, 1)]
    view, values, kept = JournaledView(keys), ValueModel(0.5), ExpectedMisses()
    view.used_expert_keys = ((0, 0), (0, 1))
    values.update(view)  # both 0.5
    assert kept.seconds(view, values, LOAD_S.__getitem__) == pytest.approx(2 * 0.5 * LOAD_S[Tier.DISK])
    view.set((0, 1), True, Tier.DISK)  # loaded: no longer a miss
    view.set((0, 0), False, Tier.HOST)  # its home is now the host cache
    assert kept.seconds(view, values, LOAD_S.__getitem__) == pytest.approx(0.5 * LOAD_S[Tier.HOST])
    view.used_expert_keys = ()
    for _ in range(40):  # decays below the prune floor: forgotten
        values.update(view)
    assert kept.seconds(view, values, LOAD_S.__getitem__) == 0.0
    assert kept.parts == {}

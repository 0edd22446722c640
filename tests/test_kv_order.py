"""`Recency.kv_lru_first` kept incrementally from the simulated view's residency journal (`KVOrder`) gives the
same KV victims in the same order as the per-call walk of every request's blocks, through random writes,
spills, frees, promotions, running-set changes and recency updates, and while victims are taken mid-walk."""

from __future__ import annotations

import random
from typing import Any

import pytest

from fallbackgate.controllers.base import Recency
from fallbackgate.engine.tags import Tier
from fallbackgate.tracing.devices import DeviceModel
from fallbackgate.tracing.simulate import SimulatedView


class NoJournal:
    """The same view keeping no KV journal (`kv_changes_since` says so): `kv_lru_first` walks it the old way."""

    def __init__(self, view: SimulatedView) -> None:
        self._view = view

    def __getattr__(self, name: str) -> Any:
        if name == "kv_changes_since":
            return lambda cursor: (None, -1)
        return getattr(self._view, name)


class Used:
    """What `Recency.touch` reads: the keys used in the last step."""

    def __init__(self, experts: tuple = (), kv: tuple = ()) -> None:
        self.used_expert_keys, self.used_kv_block_keys = experts, kv


def _view(num_layers: int) -> SimulatedView:
    device = DeviceModel("test", 1000.0, 1e9)
    return SimulatedView(device, 1 << 40, num_layers, 4, 1 << 20, 1 << 16, 16, {})


def _mutate(rng: random.Random, view: SimulatedView, rids: list[str], num_layers: int) -> None:
    """One random change of the device blocks."""
    op = rng.random()
    keys = list(view.kv)
    if op < 0.45 or not keys:  # a write (or a block coming back on device)
        key = (rng.choice(rids), rng.randrange(num_layers), rng.randrange(8))
        view.set_kv(key, (Tier.DEVICE, None, 0))
    elif op < 0.8:
        view.set_kv(rng.choice(keys), (Tier.HOST, None, 0))
    elif op < 0.9:
        gone = rng.choice(rids)
        for key in [k for k in view.kv if k[0] == gone]:
            view.drop_kv(key)
    else:
        view.running_ids = tuple(r for r in rids if rng.random() < 0.5)


@pytest.mark.parametrize("seed", range(40))
def test_kept_order_is_the_walked_order(seed: int) -> None:
    rng = random.Random(seed)
    num_layers = rng.randint(1, 3)
    rids = [f"r{i}" for i in range(rng.randint(1, 5))]
    view = _view(num_layers)
    kept, walked = Recency(), Recency()
    for _ in range(300):
        for _ in range(rng.randint(0, 4)):
            _mutate(rng, view, rids, num_layers)
        if rng.random() < 0.15:  # a step end: some device blocks read
            device = list(view.device_infos)
            used = Used(kv=tuple(rng.sample(device, min(len(device), rng.randint(0, 6)))))
            kept.touch(used)
            walked.touch(used)
        expected = list(walked.kv_lru_first(NoJournal(view)))
        assert list(kept.kv_lru_first(view)) == expected
        assert kept._kv_order.view is view  # the journal path answered, not the walk
        if expected and rng.random() < 0.5:  # victims taken while the walks are open, as make_room does
            new, old = kept.kv_lru_first(view), walked.kv_lru_first(NoJournal(view))
            for _ in range(rng.randint(1, len(expected))):
                key = next(new)
                assert key == next(old)
                view.set_kv(key, (Tier.HOST, None, 0))


def test_a_view_without_a_journal_is_walked() -> None:
    view = _view(2)
    for key in [("a", 0, 0), ("a", 1, 0), ("b", 0, 0)]:
        view.set_kv(key, (Tier.DEVICE, None, 0))
    recency = Recency()
    recency.touch(Used(kv=(("a", 0, 0),)))
    assert list(recency.kv_lru_first(NoJournal(view))) == [("b", 0, 0), ("a", 1, 0), ("a", 0, 0)]
    assert recency._kv_order.view is None

"""`bench.controller_time`'s wrapping: every call counted with its time, the class as it was afterwards."""

from __future__ import annotations

import collections

import pytest

from fallbackgate.bench.controller_time import _add, timed


class Base:
    def inherited(self, x: int) -> int:
        return x + 1


class Child(Base):
    def own(self, x: int) -> int:
        if x < 0:
            raise ValueError("negative")
        return 2 * x


def test_calls_are_counted_and_the_class_is_restored() -> None:
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    child = Child()
    with timed(Child, ("own", "inherited"), totals):
        assert [child.own(3), child.inherited(3), child.inherited(4)] == [6, 4, 5]
        with pytest.raises(ValueError):
            child.own(-1)  # a call that raises is counted too
    assert totals["own"][0] == 2 and totals["inherited"][0] == 2
    assert all(seconds >= 0.0 for _, seconds in totals.values())
    assert "inherited" not in Child.__dict__ and Child.own is Child.__dict__["own"]  # as before
    assert Child.own.__qualname__ == "Child.own" and child.inherited(1) == 2
    before = dict(totals)
    child.own(1)
    assert dict(totals) == before  # no longer counted


def test_seeds_fold_into_one_row() -> None:
    row: dict = {}
    part = {"num_steps": 3, "calls": {"make_room": {"calls": 2, "seconds": 0.5}}, "runs": [{"seed": 0}]}
    _add(row, part)
    _add(row, {**part, "runs": [{"seed": 1}]})
    assert row["num_steps"] == 6 and row["calls"]["make_room"] == {"calls": 4, "seconds": 1.0}
    assert [r["seed"] for r in row["runs"]] == [0, 1]

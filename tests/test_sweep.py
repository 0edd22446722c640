"""Belady's MIN on hand-checked traces and the old headline comparison (the sweep itself: test_sweep_regime.py)."""

from __future__ import annotations

import random

import pytest

from fallbackgate.sweep.belady import belady_misses, lru_misses
from fallbackgate.sweep.metrics import headline, p99

# The textbook reference string 1 2 3 4 1 2 5 1 2 3 4 5 (as (layer, expert) keys).
TEXTBOOK = [(0, e) for e in (1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5)]


@pytest.mark.parametrize(("slots", "optimal", "lru"), [(3, 7, 10), (4, 6, 8), (5, 5, 5), (1, 12, 12)])
def test_belady_on_the_textbook_trace(slots: int, optimal: int, lru: int) -> None:
    # 3 slots by hand: misses 1 2 3, 4 evicts 3 (next use 9, farthest); hits 1 2; 5 evicts 4 (next use 10 vs 1@7
    # 2@8); hits 1 2; 3 evicts 1 (never again), 4 evicts 3 or 2; hit 5 -> 7 misses. LRU: 10 (Belady's anomaly table).
    assert belady_misses(TEXTBOOK, slots) == optimal
    assert lru_misses(TEXTBOOK, slots) == lru


def test_belady_small_hand_trace_across_layers() -> None:
    # 2 slots: a b a c a b -> misses a, b, c (evicts b: next use 5 vs a@4), b (evicts c or a; a never again) = 4
    a, b, c = (0, 0), (1, 0), (1, 1)
    assert belady_misses([a, b, a, c, a, b], 2) == 4
    assert lru_misses([a, b, a, c, a, b], 2) == 4  # LRU: c evicts b, then b evicts c: also 4 here
    assert belady_misses([], 3) == 0


def test_belady_bounds_lru_and_compulsory_misses() -> None:
    rng = random.Random(7)
    for _ in range(50):
        trace = [(rng.randrange(3), rng.randrange(6)) for _ in range(rng.randrange(1, 120))]
        distinct = len(set(trace))
        for slots in (1, 2, 4, 8, 32):
            opt = belady_misses(trace, slots)
            assert distinct <= opt <= lru_misses(trace, slots)
            if slots >= distinct:
                assert opt == distinct
        assert belady_misses(trace, 2) >= belady_misses(trace, 3)  # MIN has no anomaly


def test_belady_rejects_zero_slots() -> None:
    with pytest.raises(ValueError, match="num_slots"):
        belady_misses(TEXTBOOK, 0)


def test_p99_nearest_rank() -> None:
    assert p99([]) == 0.0
    assert p99([3.0]) == 3.0
    assert p99([float(i) for i in range(1, 101)]) == 99.0
    assert p99([1.0, 2.0]) == 2.0


def test_headline_compares_joint_with_the_best_static_split() -> None:
    def point(ctrl: str, tpot: float, exact: float, belady: float, **extra: float) -> dict:
        cell = {"expert_frac": 0.4, "kv_frac": 0.5, "device_budget_mb": 5.0, "run_id": 1}
        cell |= {"expert_budget_bytes": 4, "kv_budget_bytes": 1}
        metrics = {"tpot_mean_ms": tpot, "modeled_tpot_mean_ms": 2 * tpot, "expert_exact_bytes": exact}
        metrics |= {"belady_expert_bytes": belady}
        metrics |= {"belady_expert_bytes_all_slots": belady / 2, "slo_attainment": 0.5}
        return {"controller": ctrl, **cell, **extra, "metrics": metrics}

    points = [
        point("joint", 0.6, 120.0, 90.0),
        point("static_split", 1.0, 150.0, 100.0),
        point("exact_lru", 1.2, 160.0, 100.0),
        point("static_split", 0.8, 140.0, 100.0, static_frac=0.9),
    ]
    h = headline(points, 0.4)
    assert h["exact_trace_from"] == "exact_lru"
    assert h["joint_over_belady"] == pytest.approx(1.2)
    assert h["best_static_tpot_ms"] == 0.8 and h["best_static_split_expert_share"] == 0.9
    assert h["joint_tpot_gain"] == pytest.approx(0.25)  # measured
    assert h["joint_modeled_tpot_gain"] == pytest.approx(0.25)  # the what-if, beside it

"""The joint controller's expert victim order: value per byte over the expected steps to the next use.

A step walks the layers in order; when the experts one step uses do not fit, the order must not degenerate
into LRU (which evicts exactly what the walk needs next) but keep what Belady's MIN keeps.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import fallbackgate
from fallbackgate.bench.victims_oracle import recorded_walk, rule_loads
from fallbackgate.controllers.expert_rank import ExpertRanking
from fallbackgate.controllers.values import ValueModel
from fallbackgate.engine.hardware import CPU_BOX
from fallbackgate.engine.static_view import StaticView
from fallbackgate.engine.tags import Tier
from fallbackgate.sweep.belady import belady_misses

NUM_LAYERS, EXPERT_BYTES = 4, 1 << 16
# stop 34's kept traces (16-token answers), on which the README's stop 37-39 figures were measured
TRACES = Path(fallbackgate.__file__).parent / "bench/results/victims-oracle-2026-12-05/traces"
TRACE = TRACES / "long-retrieval_0_joint_0.25_None"


def _view(on_device: list, used: tuple = (), num_layers: int = NUM_LAYERS) -> StaticView:
    return StaticView(
        CPU_BOX,
        on_device_experts=tuple(sorted(on_device)),
        expert_homes={},
        bytes_per_expert=EXPERT_BYTES,
        num_layers=num_layers,
        used_expert_keys=used,
    )


def test_urgency_is_value_for_the_layer_just_run_and_grows_as_its_layer_nears() -> None:
    values = ValueModel(0.9)
    values.set_frequencies({(2, 0): 0.5, (2, 1): 0.05})
    view = _view([(2, 0), (2, 1)])
    seconds_per_byte = CPU_BOX.transfer_s(EXPERT_BYTES, Tier.HOST) / EXPERT_BYTES
    assert values.expert_urgency((2, 0), view, 2) == pytest.approx(values.expert_value((2, 0), view))
    # p = 0.5 per step; from layer 1 the next use is 1/4 + 1/p - 1 = 1.25 steps away, from layer 2 it is 2
    assert values.expert_urgency((2, 0), view, 1) == pytest.approx(seconds_per_byte / 1.25)
    assert values.expert_urgency((2, 0), view, 2) == pytest.approx(seconds_per_byte / 2.0)
    assert values.expert_urgency((2, 0), view, -1) == pytest.approx(seconds_per_byte / 1.75)
    assert values.expert_urgency((3, 0), view, 1) == 0.0  # never used
    # a hot expert whose layer just ran goes before a colder one whose layer is next
    values.set_frequencies({(1, 0): 0.9, (2, 5): 0.7})
    ranking = ExpertRanking()
    both = _view([(1, 0), (2, 5)])
    ranking.sync(both, values)
    assert [key for _, key in ranking.victims(both, values, (), current_layer=1)] == [(1, 0), (2, 5)]
    assert [key for _, key in ranking.victims(both, values, (), current_layer=2)] == [(2, 5), (1, 0)]


def test_a_recorded_layer_walk_larger_than_the_cache_misses_near_beladys_min() -> None:
    walk, num_layers = recorded_walk(TRACE)
    trace = [key for keys in walk for key in keys]
    assert len(walk) > 20 and len(set(trace)) > 40
    for num_slots, most in ((28, 1.36), (40, 1.32)):  # a step uses 23 of the 64 experts on average
        floor = belady_misses(trace, num_slots)
        urgency, value, lru = (rule_loads(r, walk, num_layers, num_slots) for r in ("urgency", "frequency", "lru"))
        assert urgency <= most * floor, (num_slots, urgency, floor)
        assert urgency < 0.92 * value and urgency < 0.7 * lru, (num_slots, urgency, value, lru)


def test_even_true_routing_rates_leave_the_mixed_walk_above_1_3x_beladys_min() -> None:
    """The limit of rate-based rules: told each expert's true share of the run's steps in advance, the same
    urgency reads fewer experts than the online one, but on the mixed workload's walk still more than 1.3×
    what MIN reads: the order of future routing, not its rates, is what the rest needs."""
    walk, num_layers = recorded_walk(TRACE.parent / "mixed_0_joint_0.25_None")
    floor = belady_misses([key for keys in walk for key in keys], 28)
    online, oracle = (rule_loads(r, walk, num_layers, 28) for r in ("urgency", "oracle_rates"))
    assert oracle < online
    assert 1.3 * floor < oracle < 1.45 * floor, (oracle, floor)


def test_even_knowing_the_rest_of_each_step_leaves_the_mixed_walk_above_1_3x_beladys_min() -> None:
    """The limit of a cross-layer predictor: told exactly which experts the rest of each step routes to (a
    perfect next-layers predictor), the urgency order keeps them and reads fewer experts than online, yet on
    the mixed walk still more than 1.3× MIN: the misses over MIN come from the routing of later steps."""
    walk, num_layers = recorded_walk(TRACE.parent / "mixed_0_joint_0.25_None")
    floor = belady_misses([key for keys in walk for key in keys], 28)
    online, told = (rule_loads(r, walk, num_layers, 28) for r in ("urgency", "oracle_step"))
    assert told < 0.95 * online
    assert 1.3 * floor < told < 1.45 * floor, (told, online, floor)

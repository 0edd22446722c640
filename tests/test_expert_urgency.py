"""The joint controller's expert victim order: value per byte over the expected steps to the next use.

A step walks the layers in order; when the experts one step uses do not fit, the order must not degenerate
into LRU (which evicts exactly what the walk needs next) but keep what Belady's MIN keeps.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest

import fallbackgate
from fallbackgate.controllers.expert_rank import ExpertRanking
from fallbackgate.controllers.values import ValueModel
from fallbackgate.engine.hardware import CPU_BOX
from fallbackgate.engine.tags import Tier
from fallbackgate.sweep.belady import belady_misses
from fallbackgate.tracing.reader import read_trace
from tests.static_view import StaticView

NUM_LAYERS, EXPERT_BYTES = 4, 1 << 16
TRACE = Path(fallbackgate.__file__).parent / "sweep_results/report/traces/long-retrieval_0_joint_0.25_None"


def _recorded_walk() -> tuple[list[list[tuple[int, int]]], int]:
    """Per step, the distinct experts each layer used, in layer order, in a real run of the bundled model
    (long retrieval, seed 0, kept by the sweep), and its decoder layer count."""
    trace = read_trace(str(TRACE))
    used = trace.frame("expert_access").drop_duplicates(["step", "layer", "expert"])
    steps = [
        [
            (int(layer), int(expert))
            for layer, expert in group.sort_values(["layer", "expert"])[["layer", "expert"]].itertuples(index=False)
        ]
        for _, group in used.groupby("step", sort=True)
    ]
    return steps, int(trace.metadata["model"]["num_layers"])


def _view(on_device: list, used: tuple = (), num_layers: int = NUM_LAYERS) -> StaticView:
    return StaticView(
        CPU_BOX,
        on_device_experts=tuple(sorted(on_device)),
        expert_homes={},
        bytes_per_expert=EXPERT_BYTES,
        num_layers=num_layers,
        used_expert_keys=used,
    )


def _misses(steps: list, num_layers: int, num_slots: int, rule: str) -> int:
    """Loads of a demand cache of `num_slots` experts whose victim is chosen by `rule`: "urgency" (the
    joint's ranking at the layer the step is at), "value" (frequency alone, the order before) or "lru"."""
    values, ranking, resident, misses = ValueModel(0.9), ExpertRanking(), OrderedDict(), 0
    for keys in steps:
        for layer in range(num_layers):
            pinned = {k for k in keys if k[0] == layer}
            for key in sorted(pinned):
                if key in resident:
                    resident.move_to_end(key)
                    continue
                misses += 1
                if len(resident) >= num_slots:
                    resident.pop(_victim(rule, resident, pinned, values, ranking, layer, num_layers))
                resident[key] = None
        values.update(_view(list(resident), tuple(keys), num_layers))
    return misses


def _victim(
    rule: str, resident: OrderedDict, pinned: set, values: ValueModel, ranking: ExpertRanking, layer: int, n: int
):
    if rule == "lru":
        return next(k for k in resident if k not in pinned)
    view = _view(list(resident), (), n)
    if rule == "value":
        return min((k for k in resident if k not in pinned), key=lambda k: (values.expert_value(k, view), k))
    ranking.sync(view, values)
    return next(iter(ranking.victims(view, values, pinned, layer)))[1]


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
    steps, num_layers = _recorded_walk()
    trace = [key for keys in steps for key in keys]
    assert len(steps) > 20 and len(set(trace)) > 40
    for num_slots, most in ((28, 1.36), (40, 1.32)):  # a step uses 23 of the 64 experts on average
        floor = belady_misses(trace, num_slots)
        urgency, value, lru = (_misses(steps, num_layers, num_slots, rule) for rule in ("urgency", "value", "lru"))
        assert urgency <= most * floor, (num_slots, urgency, floor)
        assert urgency < 0.92 * value and urgency < 0.7 * lru, (num_slots, urgency, value, lru)

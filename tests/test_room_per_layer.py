"""A layer's expert loads ask for their room once (`MissFetching._room_for_all`): the same victims, in the same
order, and the same tokens as asking once per load, from one walk of the controller's order instead of one per
load (a prefill that misses 35 experts paid 35 walks; measured in stop 47's closing note)."""

from __future__ import annotations

import random

import pytest

from fallbackgate.controllers import ControllerKind, make_controller
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.experts.miss_fetch import MissFetching
from fallbackgate.engine.sequence import SamplingParams
from tests.test_engine_exact import sizes

NEW_TOKENS = 5


def _serve(path, kind: ControllerKind, budget: int) -> tuple[list, list[list[int]], int]:
    """Evicted keys in order, each request's tokens, and how many victim walks the controller was asked for."""
    controller = make_controller(kind)
    engine = Engine(
        EngineConfig(model_dir=str(path), block_size=4, max_num_seqs=3, device_budget_bytes=budget), controller
    )
    evicted: list = []
    evict, choose = engine.expert_store.evict, controller.choose_victims
    num_walks = [0]

    def recorded_evict(key):
        evicted.append(key)
        return evict(key)

    def counted_choose(*args, **kwargs):
        num_walks[0] += 1
        return choose(*args, **kwargs)

    engine.expert_store.evict, controller.choose_victims = recorded_evict, counted_choose
    rng = random.Random(3)
    ids = [
        engine.add_request([rng.randrange(3, 300) for _ in range(n)], SamplingParams(max_new_tokens=NEW_TOKENS))
        for n in (31, 7, 19)
    ]
    while engine.has_unfinished():
        engine.step()
    tokens = [engine.finished[i].output_token_ids for i in ids]
    engine.close()
    return evicted, tokens, num_walks[0]


@pytest.mark.parametrize("kind", [ControllerKind.EXACT_LRU, ControllerKind.STATIC_SPLIT, ControllerKind.JOINT])
def test_one_walk_per_layer_takes_the_victims_one_walk_per_load_takes(
    checkpoint_factory, monkeypatch, kind: ControllerKind
) -> None:
    path = checkpoint_factory("qwen3_moe")
    expert, block, layers, _ = sizes(path)
    budget = 5 * expert + 16 * layers * block  # a prefill's experts of one layer do not all fit beside the others
    batched = _serve(path, kind, budget)
    monkeypatch.setattr(MissFetching, "_room_for_all", lambda self, keys, pins: None)
    per_load = _serve(path, kind, budget)
    assert len(batched[0]) > 20  # the budget really evicts
    assert batched[0] == per_load[0]  # the same victims in the same order
    assert batched[1] == per_load[1]
    assert batched[2] < per_load[2]  # fewer walks for them

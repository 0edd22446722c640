"""While an engine serves, the heap as it was at the start is out of the garbage collector's reach (so a full
collection cannot walk it inside a step), and it is handed back when the last serving loop ends — also when
the loop fails."""

from __future__ import annotations

import gc

import pytest

from fallbackgate.batch.prompts import PromptSpec
from fallbackgate.batch.session import RunSettings, run_prompts
from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine import heap
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.engine import Engine


def test_serving_leaves_the_startup_heap_out_of_every_collection_and_hands_it_back(checkpoint_factory) -> None:
    engine = Engine(EngineConfig(model_dir=str(checkpoint_factory("olmoe")), block_size=4), ExactLRUController())
    kept_before = [[i] for i in range(200_000)]  # a long process's heap: lists the collector tracks
    num_tracked_before = len(gc.get_objects())
    seen: list[tuple[int, int]] = []

    def on_step(plan, result) -> None:  # noqa: ANN001
        seen.append((gc.get_freeze_count(), len(gc.get_objects())))

    specs = [PromptSpec("one two three four", "a", max_new_tokens=4), PromptSpec("five six", "b", max_new_tokens=3)]
    outcome = run_prompts(engine, specs, RunSettings(model_dir=engine.config.model_dir), on_step, False)
    assert [len(o.output_token_ids) for o in outcome.outputs] == [4, 3] and len(seen) >= 4
    assert all(frozen >= num_tracked_before for frozen, _ in seen)  # the start-up heap, kept_before included
    assert all(tracked < num_tracked_before // 10 for _, tracked in seen)  # what a full collection would walk
    assert gc.get_freeze_count() == 0 and len(gc.get_objects()) >= num_tracked_before
    assert len(kept_before) == 200_000
    engine.close()


def test_nested_loops_keep_the_heap_frozen_until_the_last_ends_and_a_failure_releases() -> None:
    with heap.frozen_while_serving():
        assert gc.get_freeze_count() > 0
        with heap.frozen_while_serving():
            pass
        assert gc.get_freeze_count() > 0, "an inner loop's end does not unfreeze the outer one's heap"
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError, match="a failed step"):
        with heap.frozen_while_serving():
            raise RuntimeError("a failed step")
    assert gc.get_freeze_count() == 0

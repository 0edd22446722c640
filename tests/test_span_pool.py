"""Read buffers are recycled only once no tensor views them, and idle ones beyond the cap are unmapped."""

from __future__ import annotations

import torch

from fallbackgate.engine.experts.span_pool import GRANULE, SpanPool


def test_a_mapping_is_reused_only_after_its_last_view_is_gone() -> None:
    pool = SpanPool(max_idle=1)
    first = pool.get(1000)
    view = torch.frombuffer(first, dtype=torch.uint8)[10:20].view(torch.int16)
    del first
    second = pool.get(1000)
    assert pool.num_created == 2 and pool.num_reused == 0  # the view still holds the first mapping
    second[:4] = b"abcd"
    del second, view
    third = pool.get(GRANULE)  # same rounded size
    assert pool.num_reused == 1 and len(pool.groups[GRANULE]) == 1  # both idle: one kept, one unmapped
    assert len(third) == GRANULE


def test_idle_mappings_beyond_the_cap_are_unmapped() -> None:
    pool = SpanPool(max_idle=1)
    held = [pool.get(5000) for _ in range(4)]
    del held
    pool.get(5000)
    assert len(pool.groups[GRANULE]) == 1  # three of the four idle mappings were closed, one handed out

"""Preparing persisted low-bit expert copies (``LowbitDiskCache.fill``): the cap checked before any read, an
unreadable expert skipped (its fault is found on first use), the index written once and read back by the
next process, copies keyed by the compute dtype they were made from."""

from __future__ import annotations

import pathlib

import torch

from fallbackgate.engine.errors import ExpertReadError
from fallbackgate.engine.experts.lowbit_cache import LowbitDiskCache
from fallbackgate.engine.experts.weights import ExpertWeights
from fallbackgate.engine.io import IOPriority, IOScheduler, io_context
from fallbackgate.engine.tags import ObjectKind

SHAPES = ((16, 8), (8, 4))  # gate_up [2I, H], down [H, I]


def _cache(root: pathlib.Path, num_slots: int, dtype: torch.dtype = torch.float32) -> LowbitDiskCache:
    probe = LowbitDiskCache(root / "probe", "h", 8, SHAPES, 0, dtype)
    slot_bytes = probe.slot_bytes
    probe.close()
    return LowbitDiskCache(root, "h", 8, SHAPES, num_slots * slot_bytes, dtype)


def test_fill_stops_at_the_cap_skips_unreadable_experts_and_persists_one_index(tmp_path: pathlib.Path) -> None:
    reads: list[tuple[int, int]] = []

    def read(key: tuple[int, int]) -> ExpertWeights:
        reads.append(key)
        if key == (0, 1):
            raise ExpertReadError("planted: checksum mismatch", "0" * 16, "f" * 16)
        gen = torch.Generator().manual_seed(key[0] * 100 + key[1])
        return ExpertWeights(torch.randn(SHAPES[0], generator=gen), torch.randn(SHAPES[1], generator=gen))

    cache = _cache(tmp_path, num_slots=2)
    keys = [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert cache.fill(keys, read) == 2
    assert reads == [(0, 0), (0, 1), (0, 2)]  # the cap is checked before a read: (0, 3) is never read
    assert set(cache.slots) == {"0:0", "0:2"} and (0, 1) not in cache
    cache.close()
    again = _cache(tmp_path, num_slots=2)
    assert again.slots == cache.slots  # the index, written once at the end, is what the next process reads
    assert again.fill(keys, read) == 0 and reads[3:] == []  # full: nothing read
    copy = again.get((0, 2))
    assert copy is not None and copy[0].codes.shape == SHAPES[0]
    again.close()
    other = _cache(tmp_path, num_slots=2, dtype=torch.bfloat16)
    assert other.dir != again.dir and other.dir.name == "int8-bfloat16" and not other.slots  # not another dtype's
    other.close()


def test_a_persisted_copy_is_read_on_the_engines_io_queue_for_the_callers_requests(tmp_path: pathlib.Path) -> None:
    """With the engine's I/O scheduler attached a read is one queued transfer of the slot (the same bytes as
    read inline), recorded for the requests and at the priority of the caller's io_context."""
    cache = _cache(tmp_path, num_slots=2)
    gen = torch.Generator().manual_seed(3)
    weights = ExpertWeights(torch.randn(SHAPES[0], generator=gen), torch.randn(SHAPES[1], generator=gen))
    assert cache.fill([(1, 4)], lambda _: weights) == 1
    inline = cache.get((1, 4))
    assert inline is not None and cache.num_bytes_read == cache.slot_bytes
    with IOScheduler(num_workers=1) as io:
        cache.io = io
        with io_context(("r1", "r2"), IOPriority.EXPERT_MISS, "1:4") as ctx:
            queued = cache.get((1, 4))
        (record,) = io.take_completed()
    assert queued is not None and all(torch.equal(a.codes, b.codes) for a, b in zip(queued, inline, strict=True))
    assert cache.num_bytes_read == 2 * cache.slot_bytes == 2 * record.num_bytes_done
    assert (record.object_id, record.requester_ids, record.priority) == ("1:4", ("r1", "r2"), IOPriority.EXPERT_MISS)
    assert record.object_kind is ObjectKind.EXPERT and ctx.last_end_ns == record.end_ns > 0
    cache.close()


def test_a_read_the_scheduler_refuses_keeps_the_entry(tmp_path: pathlib.Path) -> None:
    """A closed scheduler is a transfer's fault, not the copy's: `get` answers None and the index keeps it."""
    cache = _cache(tmp_path, num_slots=1)
    weights = ExpertWeights(torch.ones(SHAPES[0]), torch.ones(SHAPES[1]))
    assert cache.fill([(0, 0)], lambda _: weights) == 1
    io = IOScheduler(num_workers=1)
    io.close()
    cache.io = io
    assert cache.get((0, 0)) is None and (0, 0) in cache and cache.num_bytes_read == 0
    cache.io = None
    assert cache.get((0, 0)) is not None
    cache.close()

"""Preparing persisted low-bit expert copies (``LowbitDiskCache.fill``): the cap checked before any read, an
unreadable expert skipped (its fault is found on first use), the index written once and read back by the
next process, copies keyed by the compute dtype they were made from."""

from __future__ import annotations

import pathlib

import torch

from fallbackgate.engine.errors import ExpertReadError
from fallbackgate.engine.experts.lowbit_cache import LowbitDiskCache
from fallbackgate.engine.experts.weights import ExpertWeights

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

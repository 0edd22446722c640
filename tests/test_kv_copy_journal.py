"""The KV store's copy journal: every host and disk copy written, read and freed, in order, with ordinals that
count each change once; like changes in a row share one entry."""

from __future__ import annotations

import pathlib

import pytest
import torch

from fallbackgate.engine.device_pool import TierPool
from fallbackgate.engine.errors import ChecksumError
from fallbackgate.engine.kv.spill import SpillDir
from fallbackgate.engine.kv.store import KVStore, SpillMode
from fallbackgate.engine.messages import CopyAction
from fallbackgate.engine.tags import Tag, Tier


def _store(tmp_path: pathlib.Path) -> KVStore:
    device, host = TierPool("device", 1 << 20), TierPool("host", 1 << 20)
    kv = KVStore(1, 2, 8, 8, 4, device, host, SpillDir(tmp_path), torch.device("cpu"))
    kv.add_sequence("r")
    kv.append("r", 8)  # two full blocks
    kv.write("r", 0, 0, torch.randn(2, 8, 8), torch.randn(2, 8, 8))
    return kv


def _changes(kv: KVStore) -> list[tuple[int, str, str, int, list[int], int]]:
    return [(c.seq, c.action.value, c.tier.value, c.bits, c.block_ids, c.num_bytes) for c in kv.take_copy_changes()]


def test_spills_reads_and_frees_are_noted_in_order(tmp_path: pathlib.Path) -> None:
    kv = _store(tmp_path)
    first, second = kv.blocks("r", 0)
    kv.spill_block(first, SpillMode.HOST_FULL_AND_INT8)
    kv.spill_block(second, SpillMode.DISK_FULL)
    full, quant = kv.bytes_per_block, first.host_q.num_bytes
    kv.stage(first, Tag.KV_DEQUANT)
    kv.stage(second, Tag.EXACT_LOAD)
    kv.clear_scratch()
    kv.free_sequence("r")
    assert _changes(kv) == [
        (0, "written", "host", 0, [0], full),
        (1, "written", "host", 8, [0], quant),
        (2, "written", "disk", 0, [1], full),
        (3, "read", "host", 8, [0], quant),
        (4, "read", "disk", 0, [1], full),
        (5, "freed", "host", 0, [0], 0),
        (6, "freed", "host", 8, [0], 0),
        (7, "freed", "disk", 0, [1], 0),
    ]
    assert kv.num_copy_changes == 8 and _changes(kv) == []  # taken once


def test_like_changes_in_a_row_share_an_entry(tmp_path: pathlib.Path) -> None:
    kv = _store(tmp_path)
    for block in kv.blocks("r", 0):
        kv.spill_block(block, SpillMode.HOST_FULL)
    (change,) = kv.take_copy_changes()
    assert (change.seq, change.action, change.tier, change.block_ids) == (0, CopyAction.WRITTEN, Tier.HOST, [0, 1])
    assert change.num_bytes == 2 * kv.bytes_per_block


def test_a_disk_copy_failing_its_checksum_is_freed_not_read(tmp_path: pathlib.Path) -> None:
    kv = _store(tmp_path)
    block = kv.blocks("r", 0)[0]
    kv.spill_block(block, SpillMode.DISK_FULL)
    with open(block.disk.path, "r+b") as fh:  # one byte of the copy changes on disk
        fh.seek(block.disk.offset)
        byte = fh.read(1)
        fh.seek(block.disk.offset)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ChecksumError):
        kv.stage(block, Tag.EXACT_LOAD)
    assert [(c[1], c[2]) for c in _changes(kv)] == [("written", "disk"), ("freed", "disk")]

"""Spill writes behind a step: a step's end queues its spills' disk writes and returns; the next step waits for
them before it schedules. Their bytes stay charged to the RAM budget until then, a record read or freed earlier
waits for its own write, a failed write is reported where it is settled as a synchronous write's failure is, and
tokens do not change."""

from __future__ import annotations

import errno
import pathlib

import pytest
import torch

from fallbackgate.controllers.base import full_block_keys
from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.controller import ControllerView, StepEndActions
from fallbackgate.engine.device_pool import Scratch, TierPool
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.errors import EngineError
from fallbackgate.engine.io import IOOp, IOScheduler
from fallbackgate.engine.io import scheduler as io_scheduler
from fallbackgate.engine.kv.block import SpillMode
from fallbackgate.engine.kv.spill import SpillDir
from fallbackgate.engine.kv.store import KVStore
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.engine.tags import ObjectKind, Tag, Tier
from tests.test_engine_exact import NEW_TOKENS, _prompts, reference

KV = ObjectKind.KV_BLOCK


def _spill(tmp_path: pathlib.Path) -> tuple[SpillDir, IOScheduler]:
    io = IOScheduler(num_workers=2)
    spill = SpillDir(tmp_path, segment_bytes=1 << 20)
    spill.attach_io(io)
    return spill, io


def test_writes_behind_are_held_until_read_or_finished_and_come_back_exactly(tmp_path: pathlib.Path) -> None:
    spill, io = _spill(tmp_path)
    tensors = [torch.full((256,), float(i)) for i in range(3)]  # 1 KiB each: one 4 KiB extent each
    with spill.writing_behind():
        records = [spill.write(f"b{i}", t) for i, t in enumerate(tensors)]
    assert spill.num_pending_bytes == 3 * 4096 and not spill.is_writing_behind
    assert torch.equal(spill.read(records[1]), tensors[1])  # its own write is waited for first
    assert spill.num_pending_bytes == 2 * 4096
    spill.delete(records[2])  # an extent is freed only once written: the next write of its size reuses it
    assert spill.num_pending_bytes == 4096
    spill.finish_writes()
    assert spill.num_pending_bytes == 0
    assert spill.write("again", tensors[2]).offset == records[2].offset
    assert torch.equal(spill.read(records[0]), tensors[0])
    assert sum(r.op is IOOp.WRITE for r in io.take_completed()) == 4  # three behind, one at once
    spill.close()
    io.close()


def test_a_failed_write_behind_is_reported_where_it_is_settled(tmp_path: pathlib.Path, monkeypatch) -> None:
    spill, io = _spill(tmp_path)
    real = io_scheduler.write_from

    def failing(fd, is_direct, record, data, bounce):  # noqa: ANN001, ANN202 - the scheduler's signature
        if record.object_id == "b1":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, is_direct, record, data, bounce)

    monkeypatch.setattr(io_scheduler, "write_from", failing)
    tensors = [torch.full((256,), float(i)) for i in range(3)]
    with spill.writing_behind():
        records = [spill.write(f"b{i}", t) for i, t in enumerate(tensors)]
    where = f"spill directory {tmp_path}: cannot write b1 \\(1024 B: .*No space left on device"
    with pytest.raises(EngineError, match=where):  # as a write waited for at once would have said
        spill.read(records[1])
    with spill.writing_behind():
        records = [spill.write(f"b{i}", t) for i, t in enumerate(tensors)]
    with pytest.raises(EngineError, match=where):
        spill.finish_writes()
    assert spill.num_pending_bytes == 0  # every other write was waited for too
    assert torch.equal(spill.read(records[0]), tensors[0])
    spill.close()
    io.close()


def test_a_block_spilled_behind_keeps_its_bytes_charged_until_the_writes_finish(tmp_path: pathlib.Path) -> None:
    spill, io = _spill(tmp_path)
    ram = TierPool("RAM", 1 << 20)
    kv = KVStore(1, 2, 8, 8, 16, ram, None, spill, torch.device("cpu"))  # one 2 KiB block
    kv.write_behind_pool = ram
    kv.add_sequence("r")
    kv.append("r", 16)
    kv.write("r", 0, 0, torch.randn(2, 16, 8), torch.randn(2, 16, 8))
    block = kv.blocks("r", 0)[0]
    original, used = block.device.clone(), ram.used_bytes
    assert kv.spill_block(block, SpillMode.DISK_FULL, is_behind=True) == kv.bytes_per_block == 2048
    assert block.device is None and ram.used_bytes == used - 2048 + 4096  # the write's buffer: a 4 KiB extent
    assert ram.used_bytes_by_kind[Scratch.KV_WRITE_BEHIND] == kv.num_behind_bytes == 4096
    kv.finish_writes()
    assert ram.used_bytes == used - 2048 and kv.num_behind_bytes == 0
    assert torch.equal(kv.stage(block, Tag.EXACT_LOAD).tensor, original)
    kv.close()
    io.close()


def test_a_write_behind_the_budget_cannot_hold_is_waited_for_at_once(tmp_path: pathlib.Path) -> None:
    spill, io = _spill(tmp_path)
    ram = TierPool("RAM", 1 << 20)
    kv = KVStore(1, 2, 8, 8, 16, ram, None, spill, torch.device("cpu"))
    kv.write_behind_pool = TierPool("host", 0)  # a budget with no room for the buffer
    kv.add_sequence("r")
    kv.append("r", 16)
    kv.write("r", 0, 0, torch.randn(2, 16, 8), torch.randn(2, 16, 8))
    kv.spill_block(kv.blocks("r", 0)[0], SpillMode.DISK_FULL, is_behind=True)
    assert spill.num_pending_bytes == 0 and kv.num_behind_bytes == 0 and ram.used_bytes == 0
    kv.close()
    io.close()


class _SpillsEveryFullBlock(ExactLRUController):
    """Exact LRU that spills every full KV block to disk at each step's end (read back exactly)."""

    def on_step_end(self, view: ControllerView) -> StepEndActions:
        actions = super().on_step_end(view)
        actions.spill, actions.promote_kv = [(k, SpillMode.DISK_FULL) for k in sorted(full_block_keys(view))], []
        return actions


def test_an_engine_returns_before_its_step_end_writes_and_its_tokens_do_not_change(checkpoint_factory) -> None:
    path = checkpoint_factory("olmoe")
    prompts = _prompts(1)
    ref_tokens, _ = reference(path, prompts)
    engine = Engine(EngineConfig(model_dir=str(path), block_size=4, host_budget_bytes=0), _SpillsEveryFullBlock())
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=NEW_TOKENS)) for p in prompts]
    pool, kv = engine.kv_store.device_pool, engine.kv_store
    num_behind, disk_reads = 0, 0
    while engine.has_unfinished():
        result = engine.step()
        disk_reads += sum(
            e.count for e in result.events if e.object_kind.value == "kv_block" and e.source_tier is Tier.DISK
        )
        assert pool.used_bytes_by_kind[Scratch.KV_WRITE_BEHIND] == kv.num_behind_bytes
        assert pool.used_bytes <= pool.budget_bytes
        num_behind += kv.num_behind_bytes > 0
    assert num_behind > 0 and disk_reads > 0  # steps returned with writes in flight, and their blocks were read
    assert [engine.finished[i].output_token_ids for i in ids] == ref_tokens
    engine.close()
    assert kv.num_behind_bytes == 0 and pool.used_bytes_by_kind[Scratch.KV_WRITE_BEHIND] == 0


def test_a_write_that_fails_after_the_last_step_goes_with_the_closed_store(tmp_path: pathlib.Path, monkeypatch) -> None:
    spill, io = _spill(tmp_path)

    def failing(fd, is_direct, record, data, bounce):  # noqa: ANN001, ANN202 - the scheduler's signature
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(io_scheduler, "write_from", failing)
    ram = TierPool("RAM", 1 << 20)
    kv = KVStore(1, 2, 8, 8, 16, ram, None, spill, torch.device("cpu"))
    kv.write_behind_pool = ram
    kv.add_sequence("r")
    kv.append("r", 16)
    kv.write("r", 0, 0, torch.randn(2, 16, 8), torch.randn(2, 16, 8))
    kv.spill_block(kv.blocks("r", 0)[0], SpillMode.DISK_FULL, is_behind=True)
    assert kv.num_behind_bytes == 4096
    kv.close()  # nothing will read it: the directory it was written into goes now
    assert not spill.root.exists() and kv.num_behind_bytes == 0 and ram.used_bytes == 0
    io.close()

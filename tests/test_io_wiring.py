"""The disk as one shared link: expert reads from the checkpoint and KV spill reads and writes all go through
the engine's I/O scheduler, which the kernel's own count (``/proc/self/io`` ``read_bytes``) agrees with.

On the bundled model under a budget whose KV room is a quarter of one request's KV and no host tier, every
expert is read from the checkpoint on use and KV blocks are spilled to the spill files and read back per
layer; the tokens are those of the same request with everything in RAM.
"""

from __future__ import annotations

import pathlib
import time

import pytest
import torch

from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.errors import EngineError
from fallbackgate.engine.io import IOOp, IOPriority, IORecord, io_context
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.engine.tags import ObjectKind, Tag, Tier
from fallbackgate.sweep.measures import proc_io
from fallbackgate.tinymoe import CHECKPOINT_DIR
from tests.test_kv_pool import NEW_TOKENS, _all_in_ram, _prompt


def _spilling_engine(tmp_path: pathlib.Path, controller: ExactLRUController) -> tuple[Engine, list[int]]:
    """The bundled model with a quarter of the request's KV in the budget and no host tier; the all-in-RAM
    tokens of the same request."""
    tokens, _, kv_bytes, expert_bytes = _all_in_ram(CHECKPOINT_DIR)
    config = EngineConfig(
        model_dir=str(CHECKPOINT_DIR),
        max_num_seqs=1,
        device="cpu",
        device_budget_bytes=2 * expert_bytes + kv_bytes // 4,
        host_budget_bytes=0,
        spill_dir=str(tmp_path),
        num_io_threads=0,
    )
    return Engine(config, controller), tokens


def _slow_reads(monkeypatch: pytest.MonkeyPatch, delay_s: float = 0.01) -> None:
    """Every read through the scheduler waits `delay_s` before its real read, so the depth a transfer finds at
    submit says how the engine submits (together or one by one) and not how fast this host's disk is: a fast
    disk can finish each read before the next is queued."""
    from fallbackgate.engine.io import scheduler as scheduler_module

    real = scheduler_module.read_into

    def slow(fd, is_direct, record, buffer, bounce):
        time.sleep(delay_s)
        return real(fd, is_direct, record, buffer, bounce)

    monkeypatch.setattr(scheduler_module, "read_into", slow)


def _disk_bytes(events, kind: ObjectKind) -> int:
    return sum(e.bytes_moved for e in events if e.object_kind is kind and e.source_tier is Tier.DISK)


def test_reported_disk_loads_are_what_the_kernel_read_and_tokens_match_ram(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _slow_reads(monkeypatch)
    engine, tokens = _spilling_engine(tmp_path, ExactLRUController())
    engine.io.take_completed()  # the warm-up's reads
    before = proc_io()
    engine.add_request(_prompt(engine), SamplingParams(max_new_tokens=NEW_TOKENS), "big")
    events, records, num_shared_steps = [], [], 0
    while engine.has_unfinished():
        events += engine.step().events
        step_records = engine.io.take_completed()
        num_shared_steps += _same_step_misses(step_records)  # both kinds read in this step
        records += step_records
    after = proc_io()
    assert engine.finished["big"].output_token_ids == tokens
    expert_bytes, kv_bytes = _disk_bytes(events, ObjectKind.EXPERT), _disk_bytes(events, ObjectKind.KV_BLOCK)
    assert expert_bytes > 0 and kv_bytes > 0
    assert all(e.tag is Tag.EXACT_LOAD for e in events if e.source_tier is Tier.DISK)
    read_bytes = after["read_bytes"] - before["read_bytes"]
    assert read_bytes == pytest.approx(expert_bytes + kv_bytes, rel=0.10)  # no page cache in between
    reads = [r for r in records if r.op is IOOp.READ]
    assert all(r.is_direct and not r.error for r in records)  # around the page cache, both kinds
    assert {r.object_kind for r in reads} == {ObjectKind.EXPERT, ObjectKind.KV_BLOCK}
    assert sum(r.num_bytes for r in reads if r.object_kind is ObjectKind.KV_BLOCK) == kv_bytes
    writes = [r for r in records if r.op is IOOp.WRITE]
    assert writes and all(r.object_kind is ObjectKind.KV_BLOCK and r.priority == IOPriority.KV_WRITE for r in writes)
    kv_reads = [r for r in reads if r.object_kind is ObjectKind.KV_BLOCK]
    assert all(r.requester_ids == ("big",) and r.object_id.startswith("big:") for r in kv_reads)
    assert all(r.priority == IOPriority.KV_READ for r in kv_reads)
    assert max(r.queue_depth_at_submit for r in kv_reads) > 1  # a layer's disk blocks are queued together
    assert num_shared_steps > 0
    expert_reads = [r for r in reads if r.object_kind is ObjectKind.EXPERT]
    assert all(r.requester_ids == ("big",) and r.priority == IOPriority.EXPERT_MISS for r in expert_reads)
    engine.close()
    assert not any(tmp_path.iterdir())  # the spill files went with the engine (their descriptors first)


def _same_step_misses(records: list[IORecord]) -> bool:
    kinds = {r.object_kind for r in records if r.op is IOOp.READ}
    return kinds == {ObjectKind.EXPERT, ObjectKind.KV_BLOCK}


def test_an_expert_miss_and_a_kv_read_share_the_queue_in_one_step(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _slow_reads(monkeypatch)
    # kv_dequant: a block's quantized parts are read together, so the queue holds several transfers at once
    engine, _ = _spilling_engine(tmp_path, ExactLRUController(force=["kv_dequant"]))
    engine.io.take_completed()
    engine.add_request(_prompt(engine), SamplingParams(max_new_tokens=NEW_TOKENS), "big")
    shared_steps = []
    while engine.has_unfinished():
        result = engine.step()
        records = engine.io.take_completed()
        if _same_step_misses(records):
            shared_steps.append((result, records))
    engine.close()
    assert shared_steps  # an expert miss and a KV spill read in the same step, both through the scheduler
    deepest = max(r.queue_depth_at_submit for _, records in shared_steps for r in records)
    assert deepest > 1
    for result, records in shared_steps:
        assert any(e.tag is Tag.KV_DEQUANT and e.source_tier is Tier.DISK for e in result.events)
        arrivals = {(a.layer, a.expert_id) for a in result.expert_arrivals}
        read = {tuple(map(int, r.object_id.split(":"))) for r in records if r.object_kind is ObjectKind.EXPERT}
        assert read <= arrivals  # every expert read has its measured arrival
        assert all(0 < a.ready_s <= result.wall_s for a in result.expert_arrivals)


def test_checkpoint_spans_through_the_scheduler_equal_the_file_to_its_last_byte() -> None:
    from fallbackgate.engine.io import IOScheduler
    from fallbackgate.engine.model.checkpoint_files import CheckpointFiles

    files = CheckpointFiles(CHECKPOINT_DIR)
    names = files.names()
    last = max(names, key=lambda n: files.byte_range(n, None)[1])  # its aligned end lies past the file's end
    with IOScheduler(num_workers=2) as io:
        files.io = io
        with io_context(("r1",), IOPriority.READ_AHEAD, "0:0"):
            got = files.read_parts([(name, None) for name in names])
        records = io.take_completed()
    files.io = None
    for name, raw in zip(names, got, strict=True):
        assert raw.numpy().tobytes() == files.read(name).contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    assert last in names and all(r.is_direct and r.requester_ids == ("r1",) for r in records)
    assert all(r.priority == IOPriority.READ_AHEAD and r.object_id == "0:0" for r in records)
    sizes = sum(files.byte_range(name, None)[2] for name in names)
    assert sizes <= sum(r.num_bytes_done for r in records) < sizes + 2 * 4096 * len(records)  # aligned ranges


def test_a_direct_read_refused_by_the_file_system_is_read_buffered(tmp_path: pathlib.Path, monkeypatch) -> None:
    import errno

    from fallbackgate.engine.io import IOScheduler
    from fallbackgate.engine.io import scheduler as scheduler_module

    path = tmp_path / "data.bin"
    path.write_bytes(bytes(range(256)) * 64)
    real = scheduler_module.read_into

    def refuse_direct(fd, is_direct, record, buffer, bounce):  # what a file system without O_DIRECT reads do
        if is_direct:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, is_direct, record, buffer, bounce)

    monkeypatch.setattr(scheduler_module, "read_into", refuse_direct)
    with IOScheduler(num_workers=1) as io:
        first = io.submit_read(path, 100, 1000, ObjectKind.EXPERT, "0:0")
        assert bytes(io.wait(first)) == (bytes(range(256)) * 64)[100:1100] and not first.record.is_direct
        second = io.submit_read(path, 0, 4096, ObjectKind.EXPERT, "0:1")  # the file's descriptor stays buffered
        assert bytes(io.wait(second)) == (bytes(range(256)) * 64)[:4096] and not second.record.is_direct
        io.forget_file(path)


def test_spill_through_the_scheduler_aligns_extents_reads_direct_and_forgets_its_files(tmp_path) -> None:
    from fallbackgate.engine.errors import ChecksumError
    from fallbackgate.engine.io import IOScheduler
    from fallbackgate.engine.kv.spill import SpillDir

    io = IOScheduler(num_workers=2)
    spill = SpillDir(tmp_path, segment_bytes=1 << 20)
    spill.attach_io(io)
    tensors = [torch.full((256,), float(i)) for i in range(6)]  # 1 KiB each: one 4 KiB extent each
    with io_context(("r1",), None, "r1:0:0"):
        records = [spill.write(f"b{i}", t) for i, t in enumerate(tensors)]
        with io._lock:  # workers take nothing until all six are queued: the depths do not race the disk
            pending = [spill.submit_read(r) for r in records]  # all queued, then waited
        assert [torch.equal(spill.finish_read(p), t) for p, t in zip(pending, tensors, strict=True)] == [True] * 6
    assert [r.offset for r in records] == [i * 4096 for i in range(6)]
    done = io.take_completed()
    assert all(r.is_direct and r.requester_ids == ("r1",) for r in done)
    assert {r.priority for r in done if r.op is IOOp.WRITE} == {IOPriority.KV_WRITE}
    assert {r.priority for r in done if r.op is IOOp.READ} == {IOPriority.KV_READ}
    assert max(r.queue_depth_at_submit for r in done if r.op is IOOp.READ) >= 5  # the sixth found five before it
    data = bytearray(records[2].path.read_bytes())
    data[records[2].offset + 7] ^= 0xFF
    records[2].path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="page 0"):
        spill.read(records[2])
    with pytest.raises(EngineError, match="before its first write"):
        spill.attach_io(io)
    spill.close()
    assert not any(tmp_path.iterdir()) and not io._fds  # noqa: SLF001 - the descriptors went before the files
    io.close()

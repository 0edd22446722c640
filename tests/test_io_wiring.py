"""The disk as one shared link: expert reads from the checkpoint and KV spill reads and writes all go through
the engine's I/O scheduler, which the kernel's own count (``/proc/self/io`` ``read_bytes``) agrees with.

On the bundled model under a budget whose KV room is a quarter of one request's KV and no host tier, every
expert is read from the checkpoint on use and KV blocks are spilled to the spill files and read back per
layer; the tokens are those of the same request with everything in RAM.
"""

from __future__ import annotations

import pathlib

import pytest

from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.io import IOOp, IOPriority, IORecord
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.engine.tags import ObjectKind, Tag, Tier
from fallbackgate.tinymoe import CHECKPOINT_DIR
from tests.test_kv_pool import NEW_TOKENS, _all_in_ram, _io, _prompt


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


def _disk_bytes(events, kind: ObjectKind) -> int:
    return sum(e.bytes_moved for e in events if e.object_kind is kind and e.source_tier is Tier.DISK)


def test_reported_disk_loads_are_what_the_kernel_read_and_tokens_match_ram(tmp_path: pathlib.Path) -> None:
    engine, tokens = _spilling_engine(tmp_path, ExactLRUController())
    engine.io.take_completed()  # the warm-up's reads
    before = _io()
    engine.add_request(_prompt(engine), SamplingParams(max_new_tokens=NEW_TOKENS), "big")
    events, records = [], []
    while engine.has_unfinished():
        events += engine.step().events
        records += engine.io.take_completed()
    after = _io()
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
    expert_reads = [r for r in reads if r.object_kind is ObjectKind.EXPERT]
    assert all(r.requester_ids == ("big",) and r.priority == IOPriority.EXPERT_MISS for r in expert_reads)
    engine.close()
    assert not any(tmp_path.iterdir())  # the spill files went with the engine (their descriptors first)


def _same_step_misses(records: list[IORecord]) -> bool:
    kinds = {r.object_kind for r in records if r.op is IOOp.READ}
    return kinds == {ObjectKind.EXPERT, ObjectKind.KV_BLOCK}


def test_an_expert_miss_and_a_kv_read_share_the_queue_in_one_step(tmp_path: pathlib.Path) -> None:
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

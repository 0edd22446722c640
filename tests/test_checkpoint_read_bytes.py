"""An expert read from the checkpoint reports the bytes the files hold for it, not its compute-dtype bytes.

They differ for a block-scaled FP8 checkpoint (one byte a weight plus fp32 scales, computed in fp32) and for
a ``dtype`` override (a bf16 checkpoint computed in fp32). The RAM pool keeps counting the compute bytes a
copy holds; the exact_load events' bytes must equal the expert reads times the checkpoint's bytes per expert
and agree with what the checkpoint files' own counter says was read (O_DIRECT rounds each tensor's span out
to whole pages, so that counter may exceed them by at most two pages per tensor read).
"""

from __future__ import annotations

import pathlib

import pytest
import torch

from fallbackgate.audit import completeness
from fallbackgate.audit.completeness import CHECKPOINT_READ, check_object_bytes
from fallbackgate.batch.session import object_bytes
from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.model.checkpoint_files import DIRECT_ALIGN
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.engine.tags import ObjectKind, Tag, Tier
from tests.checkpoints import make_checkpoint
from tests.test_fp8 import _fp8_checkpoint


@pytest.fixture(scope="module", params=["fp8", "bf16-as-fp32"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "fp8":  # the synth writer's FP8 layout, at test size (computed in fp32)
        return _fp8_checkpoint(root, "qwen3_moe")
    return make_checkpoint("qwen3_moe", root / "bf16", dtype=torch.bfloat16)


def _engine(path: pathlib.Path, budget_experts: int | None) -> Engine:
    config = EngineConfig(model_dir=str(path), dtype="float32", host_budget_bytes=0, num_io_threads=0)
    if budget_experts is None:
        return Engine(config, ExactLRUController())
    probe = Engine(config, ExactLRUController())
    budget = budget_experts * probe.expert_store.bytes_per_expert
    budget += 64 * probe.kv_store.num_layers * probe.kv_store.bytes_per_block
    probe.close()
    config.device_budget_bytes = budget
    return Engine(config, ExactLRUController())


def test_a_disk_read_reports_the_checkpoint_bytes(checkpoint: pathlib.Path) -> None:
    engine = _engine(checkpoint, budget_experts=4)
    store = engine.expert_store
    stored, computed = store.checkpoint_bytes_per_expert, store.bytes_per_expert
    assert stored < computed / 1.9  # FP8 codes (plus scales) or bf16, computed in fp32
    files = store.reader.files
    reads_before, bytes_before = store.num_disk_reads, files.num_bytes_read
    for i, prompt in enumerate(([5, 9, 40, 7, 300], [17, 3, 3, 88, 100, 12, 6])):
        engine.add_request(prompt, SamplingParams(max_new_tokens=6), f"r{i}")
    reported, num_loads = 0, 0
    while engine.has_unfinished():
        for e in engine.step().events:
            if e.object_kind is ObjectKind.EXPERT and e.tag is Tag.EXACT_LOAD and e.bytes_moved:
                assert e.source_tier is Tier.DISK and e.bytes_moved % stored == 0, e
                reported += e.bytes_moved
                num_loads += e.bytes_moved // stored
        assert store.device_pool.used_bytes_by_kind[ObjectKind.EXPERT] % computed == 0  # RAM: compute bytes
    num_reads = store.num_disk_reads - reads_before
    read = files.num_bytes_read - bytes_before
    num_tensors = len(next(iter(store.reader.sources.values())).parts) + len(
        next(iter(store.reader.sources.values())).scale_parts
    )
    engine.close()
    assert num_loads > 10 and num_loads == num_reads
    assert reported == num_reads * stored
    assert reported <= read <= reported + num_reads * num_tensors * 2 * DIRECT_ALIGN


def test_the_byte_check_knows_both_sizes(checkpoint: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gate's object sizes hold an expert's compute bytes (a memory copy moved) and its checkpoint bytes
    (a disk read); the audit's byte check passes any mix of the two and flags bytes that are neither."""
    engine = _engine(checkpoint, budget_experts=None)
    sizes = object_bytes(engine)
    stored, computed = engine.expert_store.checkpoint_bytes_per_expert, engine.expert_store.bytes_per_expert
    engine.close()
    assert (sizes[ObjectKind.EXPERT.value], sizes[CHECKPOINT_READ]) == (computed, stored)
    for num_bytes, is_ok in ((3 * stored, True), (2 * stored + computed, True), (stored + 1, False)):
        row = dict(step_id=1, request_id="r", layer=0, object_kind="expert", tag="exact_load", objects=3,
                   bytes_moved=num_bytes)  # fmt: skip
        monkeypatch.setattr(completeness.audit_queries, "moved_bytes", lambda _ledger, _run, r=row: [r])
        assert (check_object_bytes(None, 0, sizes) == []) is is_ok, num_bytes  # type: ignore[arg-type]

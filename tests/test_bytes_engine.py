"""Bytes by dtype in a running engine and in the expert reader: what is reserved is what is held.

- Mixtral's per-expert w1 / w2 / w3 (gate, down, up in file order) are held once, not as the read buffer
  beside a concatenated gate_up copy (formerly ~1.67x the expert's bytes).
- A bf16 checkpoint under a tight budget, with int4 KV spills read back with kv_dequant and int4 expert
  copies: no BudgetError, and at every step end the host pool's reservations equal the storages of the
  copies held; every event's bytes are the stored bytes of the copies it moved.
"""

from __future__ import annotations

import dataclasses
import gc
import pathlib

import pytest
import torch
from safetensors.torch import save_file

from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.experts.manifest import weights_digest, write_manifest
from fallbackgate.engine.experts.quant import lowbit_expert_nbytes
from fallbackgate.engine.experts.reader import ExpertReader
from fallbackgate.engine.experts.sources import map_experts
from fallbackgate.engine.experts.span_pool import GRANULE
from fallbackgate.engine.experts.weights import ExpertWeights
from fallbackgate.engine.kv.codec import quant_kv_nbytes
from fallbackgate.engine.model.checkpoint_files import DIRECT_ALIGN, CheckpointFiles
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.engine.tags import ObjectKind, Tag
from tests.checkpoints import make_checkpoint
from tests.test_quant_bytes import held_bytes, storage_bytes

INTERMEDIATE, HIDDEN = 512, 256  # 256 KiB per bf16 matrix: the read buffer's rounding is small beside it


def _mixtral_experts(path: pathlib.Path, layout: str) -> dict[str, torch.Tensor]:
    """Two Mixtral-named bf16 experts; `one_file`: w1, w2, w3 back to back; `split`: w3 in a second file."""
    path.mkdir()
    gen = torch.Generator().manual_seed(0)
    tensors = {
        f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight": torch.randn(shape, generator=gen).bfloat16()
        for e in range(2)
        for w, shape in (("w1", (INTERMEDIATE, HIDDEN)), ("w2", (HIDDEN, INTERMEDIATE)), ("w3", (INTERMEDIATE, HIDDEN)))
    }
    is_second = {name: layout == "split" and ".w3." in name for name in tensors}
    save_file({n: t for n, t in tensors.items() if not is_second[n]}, str(path / "a.safetensors"))
    if layout == "split":
        save_file({n: t for n, t in tensors.items() if is_second[n]}, str(path / "b.safetensors"))
    digests = {}
    for e in range(2):
        part = {w: tensors[f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight"] for w in ("w1", "w2", "w3")}
        digests[(0, e)] = weights_digest(ExpertWeights(torch.cat([part["w1"], part["w3"]]), part["w2"]))
    write_manifest(path, digests, map_experts(CheckpointFiles(path)))
    return tensors


@pytest.mark.parametrize("layout", ["one_file", "split"])
def test_a_mixtral_expert_is_held_once(layout: str, tmp_path: pathlib.Path) -> None:
    tensors = _mixtral_experts(tmp_path / layout, layout)
    reader = ExpertReader(CheckpointFiles(tmp_path / layout), torch.bfloat16)
    expert_bytes = reader.checkpoint_bytes_per_expert
    weights = reader.read((0, 0))  # verified against the manifest
    name = "model.layers.0.block_sparse_moe.experts.0.{}.weight"
    assert torch.equal(weights.gate_up, torch.cat([tensors[name.format("w1")], tensors[name.format("w3")]]))
    assert torch.equal(weights.down, tensors[name.format("w2")])
    held = storage_bytes(weights.gate_up, weights.down)
    one_buffer = -(-(expert_bytes + DIRECT_ALIGN) // GRANULE) * GRANULE  # a read buffer, rounded as mapped
    assert expert_bytes <= held <= one_buffer  # formerly expert_bytes * 5 / 3 and more
    assert held <= 1.1 * expert_bytes
    spans = reader.files.spans
    reused = spans.num_reused
    del weights
    gc.collect()
    reader.read((0, 1))
    assert spans.num_reused > reused  # the first read's buffers were free again once its weights were gone


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("bf16") / "qwen3_moe", dtype=torch.bfloat16)


def _host_account(engine: Engine) -> tuple[int, int]:
    """(host bytes the pool reserves for experts and KV, storage bytes of the host copies really held)."""
    experts, kv = engine.expert_store, engine.kv_store
    held = len(experts.read_ahead.flights) * experts.bytes_per_expert  # reads in flight hold their room
    for entry in experts.entries.values():
        if entry.host is not None:
            held += entry.host.num_bytes
        if entry.lowbit is not None:
            held += sum(map(held_bytes, entry.lowbit))
    for table in kv.tables.values():
        for block in (b for blocks in table for b in blocks):
            held += block.host.nbytes if block.host is not None else 0  # a slot of the host tier tensor
            if block.host_q is not None and block.host_q.keys is not None and block.host_q.values is not None:
                held += held_bytes(block.host_q.keys) + held_bytes(block.host_q.values)
    pool = engine.kv_store.host_pool
    return pool.used_bytes_by_kind[ObjectKind.EXPERT] + pool.used_bytes_by_kind[ObjectKind.KV_BLOCK], held


def test_a_bf16_int4_run_reserves_what_it_holds(bf16_checkpoint: pathlib.Path) -> None:
    sizes = EngineConfig(model_dir=str(bf16_checkpoint), block_size=16, host_budget_bytes=0)
    probe = Engine(sizes, ExactLRUController())  # sizes only: it reads no expert
    expert, kv = probe.expert_store.bytes_per_expert, probe.kv_store
    block, layers = kv.bytes_per_block, kv.num_layers
    probe.close()
    config = EngineConfig(
        model_dir=str(bf16_checkpoint),
        block_size=16,
        max_num_seqs=2,
        device_budget_bytes=6 * expert + 8 * layers * block,
        host_budget_bytes=10 * expert,
        is_emulated_device_tier=True,  # host copies: CUDA's layout, emulated in RAM
        expert_lowbit_bits=4,
    )
    engine = Engine(config, ExactLRUController([Tag.EXPERT_LOWBIT, Tag.KV_DEQUANT], kv_quant_bits=4))
    assert engine.dtype_name == "bfloat16"
    store, kv = engine.expert_store, engine.kv_store
    lowbit_bytes = lowbit_expert_nbytes(store.reader.matrix_shapes, 4)
    assert lowbit_bytes < 0.4 * expert  # packed: a bf16 expert's int4 copy is 0.375 of it, not 0.625
    quant_block, disk_block = (quant_kv_nbytes(kv.block_shape, bits, kv.key_dim) for bits in (4, 8))
    for i, length in enumerate((40, 23)):
        engine.add_request(list(range(3, 3 + length)), SamplingParams(max_new_tokens=12), f"r{i}")
    moved: dict[Tag, list[tuple[int, int]]] = {Tag.KV_DEQUANT: [], Tag.EXPERT_LOWBIT: []}
    while engine.has_unfinished():
        for event in engine.step().events:
            if event.tag in moved:
                moved[event.tag].append((event.count, event.bytes_moved))
        reserved, held = _host_account(engine)
        assert reserved == held
    engine.close()
    assert moved[Tag.KV_DEQUANT] and moved[Tag.EXPERT_LOWBIT]
    # host copies are int4; a block whose int4 copy did not fit the host went to disk as int8
    kinds = [[n for n in range(count + 1) if n * quant_block + (count - n) * disk_block == num_bytes]
             for count, num_bytes in moved[Tag.KV_DEQUANT]]  # fmt: skip
    assert all(kinds) and any(n for k in kinds for n in k) and any(0 in k for k in kinds)
    # a fetch moves the packed copy, plus the full expert when the copy is first made from the checkpoint;
    # an event's bytes are those of the fetches counted in it (another request's use of the same fetch: 0)
    splits = [[(n, d) for n in range(count + 1) for d in range(n + 1) if n * lowbit_bytes + d * expert == num_bytes]
              for count, num_bytes in moved[Tag.EXPERT_LOWBIT]]  # fmt: skip
    assert all(splits) and any(n > d for split in splits for n, d in split)  # and some from the host copy only


def test_a_bf16_int8_kv_spill_never_overruns_the_host(bf16_checkpoint: pathlib.Path) -> None:
    """The host has room for more than a quarter of a bf16 block but less than its int8 copy (0.66 of it
    here): the copy goes to disk instead of overrunning the host reserve (the former `bytes_per_block // 4`
    check admitted it and the reserve raised BudgetError mid-run)."""
    config = EngineConfig(model_dir=str(bf16_checkpoint), block_size=64, max_num_seqs=1, host_budget_bytes=4000,
                          is_emulated_device_tier=True)
    probe = Engine(dataclasses.replace(config, host_budget_bytes=0), ExactLRUController())
    expert, kv = probe.expert_store.bytes_per_expert, probe.kv_store
    probe.close()
    assert kv.bytes_per_block // 4 + 1024 <= config.host_budget_bytes < quant_kv_nbytes(kv.block_shape, 8, kv.key_dim)
    budget = 6 * expert + 4 * kv.num_layers * kv.bytes_per_block  # no expert fits the host: it holds KV only
    engine = Engine(dataclasses.replace(config, device_budget_bytes=budget), ExactLRUController([Tag.KV_DEQUANT]))
    engine.add_request(list(range(3, 73)), SamplingParams(max_new_tokens=8), "r")
    host, dequantized, on_disk = engine.kv_store.host_pool, 0, 0
    while engine.has_unfinished():
        dequantized += sum(e.count for e in engine.step().events if e.tag is Tag.KV_DEQUANT)
        table = engine.kv_store.tables.get("r", [])
        on_disk = max(on_disk, sum(b.disk_q is not None and b.host_q is None for blocks in table for b in blocks))
        assert host.used_bytes <= host.budget_bytes
    engine.close()
    assert dequantized == kv.num_layers * 7  # each layer's full block, read back on the 7 decode steps after
    assert host.peak_used_bytes == 0 and on_disk == kv.num_layers  # int8 copies on disk, none on the host

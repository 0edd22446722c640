"""Stores, spill checksums, and the loader's errors."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.errors import CheckpointError, ChecksumError
from fallbackgate.engine.kv.block import SpillMode
from fallbackgate.engine.kv.spill import PAGE_BYTES, SpillDir
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.engine.tags import Tag, Tier
from tests.checkpoints import make_checkpoint
from tests.test_engine_exact import NEW_TOKENS, _prompts, reference, sizes


def test_spill_detects_a_corrupted_page(tmp_path: pathlib.Path) -> None:
    spill = SpillDir(tmp_path)
    tensor = torch.arange(3 * PAGE_BYTES // 4, dtype=torch.float32)
    record = spill.write("t", tensor)
    assert len(record.page_crcs) == 3
    assert torch.equal(spill.read(record), tensor)
    data = bytearray(record.path.read_bytes())  # one segment file: the record starts at its offset
    data[PAGE_BYTES + 5] ^= 0xFF
    record.path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="page 1"):
        spill.read(record)


def _disk_engine(path: pathlib.Path, sized_like: pathlib.Path | None = None) -> Engine:
    expert, block, layers, _ = sizes(sized_like or path)
    config = EngineConfig(model_dir=str(path), block_size=4, device_budget_bytes=4 * expert + 20 * layers * block)
    config.host_budget_bytes = 0  # every expert is read from the checkpoint on use
    return Engine(config, ExactLRUController())


def test_a_transient_bad_read_is_read_again_and_recorded(checkpoint_factory, monkeypatch) -> None:
    path = checkpoint_factory("qwen3_moe")
    prompts = _prompts(1)
    ref_tokens, _ = reference(path, prompts)
    engine = _disk_engine(path)
    store = engine.expert_store
    assert all(store.home(key) is Tier.DISK for key in store.entries)
    read_raw, garbled = store.reader.read_raw, set()

    def bad_first_read(key):  # each expert's first read returns one flipped bit
        weights = read_raw(key)
        if key not in garbled:
            garbled.add(key)
            weights.gate_up.view(torch.uint8).view(-1)[10] ^= 0x01
        return weights

    monkeypatch.setattr(store.reader, "read_raw", bad_first_read)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=NEW_TOKENS)) for p in prompts]
    notes = []
    while engine.has_unfinished():
        notes += [e.note for e in engine.step().events if e.tag is Tag.EXACT_LOAD and e.note]
    assert [engine.finished[i].output_token_ids for i in ids] == ref_tokens
    assert notes and all("checksum failure" in n and "re-read" in n for n in notes)


def test_a_changed_checkpoint_file_fails_the_request_naming_the_tensors(checkpoint_factory, tmp_path) -> None:
    original = checkpoint_factory("qwen3_moe")
    path = _copy(original, tmp_path / "changed")
    name = "model.layers.0.mlp.experts.0.gate_proj.weight"
    everything = load_file(str(path / "model.safetensors"))
    everything[name].view(-1)[0] += 1.0  # one weight of one expert changed after the manifest was written
    save_file(everything, str(path / "model.safetensors"), metadata={"format": "pt"})
    engine = _disk_engine(path, sized_like=original)
    rid = engine.add_request(_prompts(1)[0], SamplingParams(max_new_tokens=NEW_TOKENS))
    while engine.has_unfinished():  # the engine keeps stepping: the request fails alone
        engine.step()
    assert rid not in engine.finished
    _, why = engine.failed[rid]
    assert "quarantined: expert 0:0" in why
    record = engine.expert_store.reader.quarantine.get((0, 0))
    assert record is not None and name in record.tensors and record.found != record.expected


def test_kv_blocks_round_trip_through_disk(checkpoint_factory) -> None:
    """A swapped request's blocks go to disk (no host budget) and come back exactly on resume."""
    path = checkpoint_factory("olmoe")
    prompts = _prompts(1)
    ref_tokens, _ = reference(path, prompts)
    engine = Engine(EngineConfig(model_dir=str(path), block_size=4, host_budget_bytes=0), ExactLRUController())
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=NEW_TOKENS)) for p in prompts]
    disk_reads = 0
    for step in range(10_000):
        if not engine.has_unfinished():
            break
        if step == 3:
            engine.scheduler.preempt(engine.sequences[ids[1]])
            spill = engine.kv_store.spill
            assert spill.num_live_bytes > 0 and len(list(spill.root.glob("seg-*.bin"))) == 1  # one file, offsets
        events = engine.step().events
        disk_reads += sum(e.count for e in events if e.object_kind.value == "kv_block" and e.source_tier is Tier.DISK)
    assert disk_reads > 0
    assert [engine.finished[i].output_token_ids for i in ids] == ref_tokens
    kept = [b for table in engine.kv_store.tables.values() for blocks in table for b in blocks]  # kept prefixes
    kept_on_disk = sum(engine.kv_store.bytes_per_block for b in kept if b.disk is not None)
    assert engine.kv_store.spill.num_live_bytes == kept_on_disk  # finished requests leave only kept prefix blocks
    engine.close()
    assert not engine.kv_store.spill.root.exists()


def _copy(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    shutil.copytree(src, dst)
    return dst


def test_loader_errors_say_what_was_found(tmp_path: pathlib.Path, checkpoint_factory) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        Engine(EngineConfig(model_dir=str(tmp_path / "nope")), ExactLRUController())
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match=r"no config.json \(found: \['notes.txt'\]\)"):
        Engine(EngineConfig(model_dir=str(tmp_path / "empty")), ExactLRUController())
    dense = make_checkpoint("llama", tmp_path / "dense")
    with pytest.raises(CheckpointError, match="'llama' is not a supported MoE architecture.*qwen3_moe"):
        Engine(EngineConfig(model_dir=str(dense)), ExactLRUController())
    broken = _copy(checkpoint_factory("qwen3_moe"), tmp_path / "broken")
    (broken / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        Engine(EngineConfig(model_dir=str(broken)), ExactLRUController())
    bad_json = _copy(checkpoint_factory("qwen3_moe"), tmp_path / "badjson")
    (bad_json / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        Engine(EngineConfig(model_dir=str(bad_json)), ExactLRUController())
    dense_moe_type = _copy(checkpoint_factory("qwen3_moe"), tmp_path / "truncated")
    (dense_moe_type / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="model.safetensors: not a readable safetensors file"):
        Engine(EngineConfig(model_dir=str(dense_moe_type)), ExactLRUController())
    assert json.loads((checkpoint_factory("qwen3_moe") / "config.json").read_text())["model_type"] == "qwen3_moe"


def test_kv_block_keeps_full_and_quantized_copies(tmp_path: pathlib.Path) -> None:
    from fallbackgate.engine.device_pool import TierPool
    from fallbackgate.engine.kv.store import KVStore, SpillMode

    device, host = TierPool("device", 1 << 20), TierPool("host", 1 << 20)
    kv = KVStore(1, 2, 8, 8, 4, device, host, SpillDir(tmp_path), torch.device("cpu"))
    kv.add_sequence("r")
    kv.append("r", 6)
    keys, values = torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    kv.write("r", 0, 0, keys, values)
    block = kv.blocks("r", 0)[0]
    original = block.device.clone()
    written = kv.spill_block(block, SpillMode.HOST_FULL_AND_INT8)
    assert block.device is None and block.host is not None and block.host_q is not None
    assert written == kv.bytes_per_block + block.host_q.num_bytes
    assert host.used_bytes == written and device.used_bytes == kv.bytes_per_block  # the tail block stays
    assert torch.equal(kv.stage(block, Tag.EXACT_LOAD).tensor, original)
    dequantized = kv.stage(block, Tag.KV_DEQUANT).tensor
    error = (dequantized - original).abs().max().item()
    assert 0 < error < 0.05


def test_restored_tail_block_never_comes_back_stale(tmp_path: pathlib.Path) -> None:
    """Swap out a partial tail, bring it back, append, swap out again: the second copy has the new token."""
    from fallbackgate.engine.device_pool import TierPool
    from fallbackgate.engine.kv.store import KVStore, SpillMode

    device, host = TierPool("device", 1 << 20), TierPool("host", 1 << 20)
    kv = KVStore(1, 1, 2, 2, 4, device, host, SpillDir(tmp_path), torch.device("cpu"))
    kv.add_sequence("r")
    kv.append("r", 3)
    kv.write("r", 0, 0, torch.ones(1, 3, 2), torch.ones(1, 3, 2))
    block = kv.blocks("r", 0)[0]
    kv.spill_block(block, SpillMode.HOST_FULL)
    restored = kv.append("r", 1)  # resume: the partial tail comes back, position 3 is next
    assert len(restored) == 1 and block.host is None  # the old copy is gone once new tokens can land
    kv.write("r", 0, 3, torch.full((1, 1, 2), 7.0), torch.full((1, 1, 2), 7.0))
    assert kv.spill_block(block, SpillMode.HOST_FULL) == kv.bytes_per_block
    kv.clear_scratch()
    staged = kv.stage(block, Tag.EXACT_LOAD)
    assert staged.tensor[0, 3].tolist() == [7.0, 7.0, 7.0, 7.0]
    assert host.used_bytes == kv.bytes_per_block  # one copy accounted, not two


@pytest.mark.parametrize("mode", [SpillMode.DISK_INT8, SpillMode.HOST_INT8, SpillMode.DROP])
def test_a_partial_tail_spilled_lossy_keeps_a_full_copy_and_resumes_exactly(checkpoint_factory, mode) -> None:
    """A victim order may name a running request's partial tail with a quantized-only (or no) copy, as the
    joint controller's does for a class that may read kv_dequant; the tail is written to again, so it is kept
    in full precision and the request's tokens stay those of generate() (before: 'no full-precision copy')."""
    path = checkpoint_factory("olmoe")
    prompts = _prompts(1)
    ref_tokens, _ = reference(path, prompts)
    engine = Engine(EngineConfig(model_dir=str(path), block_size=4, host_budget_bytes=0), ExactLRUController())
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=NEW_TOKENS)) for p in prompts]
    num_tails = 0
    for step in range(10_000):
        if not engine.has_unfinished():
            break
        if step in (3, 5):
            rid = ids[1]
            for layer in range(engine.kv_store.num_layers):
                for block in engine.kv_store.blocks(rid, layer):
                    if block.device is not None and block.num_tokens < engine.kv_store.block_size:
                        engine.executor.spill_kv(block.key, mode)
                        assert block.device is None and (block.disk is not None or block.host is not None)
                        num_tails += 1
        engine.step()
    assert num_tails > 0
    assert [engine.finished[i].output_token_ids for i in ids] == ref_tokens
    engine.close()

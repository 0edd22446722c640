"""KV in pooled tensors that can outgrow the device: slot tensors, per-layer staging, the spill's segment
files, and max_model_len.

The goal check: on the bundled model, one request whose KV is at least 4x the budget's KV room (device
budget minus the expert floor) runs, with the same tokens as the same request with everything in RAM, and
the device pool's peak never passes the budget.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from fallbackgate.assembly import Overrides, engine_config, run_settings
from fallbackgate.commands import run as run_command
from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.device_pool import Scratch, TierPool
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.errors import BudgetError, EngineError, PromptError
from fallbackgate.engine.kv.layer_read import read_layer
from fallbackgate.engine.kv.slots import SlotTier
from fallbackgate.engine.kv.spill import DIR_PREFIX, SpillDir
from fallbackgate.engine.kv.store import KVStore, SpillMode
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.engine.tags import ObjectKind, Tag, Tier
from fallbackgate.policy.apply import policy_from_args
from fallbackgate.sweep.measures import proc_io
from fallbackgate.tinymoe import CHECKPOINT_DIR

PROMPT_LEN, NEW_TOKENS = 100, 4


def _prompt(engine: Engine) -> list[int]:
    vocab = int(engine.model_config.vocab_size)
    return [(i * 37) % (vocab - 5) + 5 for i in range(PROMPT_LEN)]


def _all_in_ram(model: pathlib.Path) -> tuple[list[int], torch.Tensor, int, int]:
    """The request with every expert and block in RAM (experts one by one, as under a budget): tokens,
    logits, and the sizes the test budgets from."""
    config = EngineConfig(model_dir=str(model), max_num_seqs=1, device="cpu", is_stacked_when_fits=False)
    engine = Engine(config, ExactLRUController())
    out = engine.generate([_prompt(engine)], SamplingParams(max_new_tokens=NEW_TOKENS))[0]
    kv, expert = engine.kv_store, engine.expert_store.bytes_per_expert
    engine.close()
    num_blocks = -(-(PROMPT_LEN + NEW_TOKENS) // kv.block_size)
    return out.output_token_ids, out.output_logits, num_blocks * kv.num_layers * kv.bytes_per_block, expert


def _check_layer_buffers(engine: Engine) -> list[int]:
    """After every per-layer update: the laid-out K/V's storages are exactly the bytes the pool counts for
    them (kv_gather for copied resident blocks, kv_staged for staged ones), and the pool is within budget.
    Returns a one-item list counting the updates checked."""
    runner, executor, kv = engine.runner, engine.executor, engine.kv_store
    layer_update, checked = runner.layer_update, [0]

    def checked_update(layer: int, key_states: torch.Tensor, value_states: torch.Tensor):
        result = layer_update(layer, key_states, value_states)
        pool = kv.device_pool
        slot_storages = {t.untyped_storage().data_ptr() for t in kv.device_slots.tensors}  # blocks read in place
        buffers = {k.untyped_storage().data_ptr(): k.untyped_storage().nbytes() for k, _ in executor.layer_kv}
        copied = sum(n for ptr, n in buffers.items() if ptr not in slot_storages)
        assert copied == executor.num_gather_bytes_held + executor.num_staged_bytes_held
        scratch = sum(s.tensor.nbytes for s in kv.scratch.values())
        assert pool.used_bytes_by_kind[Scratch.KV_STAGED] == executor.num_staged_bytes_held + scratch
        assert pool.used_bytes_by_kind[Scratch.KV_GATHER] == executor.num_gather_bytes_held
        assert pool.used_bytes <= pool.budget_bytes
        checked[0] += 1
        return result

    runner.layer_update = checked_update
    return checked


def _check_outgrows_the_room(model: pathlib.Path, tmp_path: pathlib.Path) -> None:
    tokens, logits, kv_bytes, expert_bytes = _all_in_ram(model)
    floor = 2 * expert_bytes  # top_k experts: what KV may never take
    budget = floor + kv_bytes // 4  # the KV room is a quarter of the request's KV
    config = EngineConfig(
        model_dir=str(model),
        max_num_seqs=1,
        device="cpu",
        device_budget_bytes=budget,
        host_budget_bytes=0,
        spill_dir=str(tmp_path),
    )
    engine = Engine(config, ExactLRUController())
    pool = engine.kv_store.device_pool
    assert engine.scheduler.expert_floor_bytes == floor
    num_checked = _check_layer_buffers(engine)
    assert kv_bytes >= 4 * (pool.budget_bytes - floor)
    before = proc_io()
    engine.add_request(_prompt(engine), SamplingParams(max_new_tokens=NEW_TOKENS), "big")
    disk_loads, per_layer_steps = 0, 0
    while engine.has_unfinished():
        result = engine.step()
        per_layer_steps += engine.scheduler.is_layer_staged
        kv_events = [e for e in result.events if e.object_kind is ObjectKind.KV_BLOCK]
        disk_loads += sum(e.count for e in kv_events if e.tag is Tag.EXACT_LOAD and e.source_tier is Tier.DISK)
        assert pool.used_bytes <= pool.budget_bytes
    after = proc_io()
    spill = engine.kv_store.spill
    out = engine.finished["big"]
    assert out.output_token_ids == tokens
    torch.testing.assert_close(out.output_logits, logits, rtol=1e-4, atol=1e-4)  # prefill chunks differ in size
    assert pool.peak_used_bytes <= pool.budget_bytes and pool.peak_bytes_by_kind[Scratch.KV_STAGED] > 0
    assert per_layer_steps > 0 and disk_loads > 0 and num_checked[0] > 0
    # every block read from disk was read from the spill files, and the kernel saw those bytes go by
    assert spill.num_read_bytes >= disk_loads * engine.kv_store.bytes_per_block
    assert after["rchar"] - before["rchar"] >= spill.num_read_bytes
    assert after["wchar"] - before["wchar"] >= spill.num_written_bytes > 0
    assert len(spill.paths) == 1  # one segment file at offsets, not a file per block
    engine.close()
    assert not any(tmp_path.glob(f"{DIR_PREFIX}*"))


def test_a_request_with_4x_the_kv_room_runs_with_the_tokens_of_the_all_in_ram_run(checkpoint_factory, tmp_path) -> None:
    _check_outgrows_the_room(checkpoint_factory("qwen3_moe"), tmp_path)


def test_on_the_bundled_model_a_request_with_4x_the_kv_room_runs_exactly(tmp_path: pathlib.Path) -> None:
    _check_outgrows_the_room(CHECKPOINT_DIR, tmp_path)


def test_a_request_too_long_even_per_layer_is_refused_with_both_needs_named(checkpoint_factory) -> None:
    model = str(checkpoint_factory("qwen3_moe"))  # small experts: the expert floor cannot hold a layer's K/V
    probe = Engine(EngineConfig(model_dir=model, max_num_seqs=1, device="cpu"), ExactLRUController())
    kv, expert = probe.kv_store, probe.expert_store.bytes_per_expert
    probe.close()
    budget = 2 * expert + kv.num_layers * kv.bytes_per_block  # the least that makes progress
    engine = Engine(EngineConfig(model_dir=model, max_num_seqs=1, device_budget_bytes=budget), ExactLRUController())
    with pytest.raises(BudgetError, match="even staged layer by layer one layer's K/V"):
        engine.add_request([5 + i % 300 for i in range(400)], SamplingParams(max_new_tokens=4))
    engine.add_request(list(range(5, 40)), SamplingParams(max_new_tokens=4))  # one that fits per layer runs
    while engine.has_unfinished():
        engine.step()
    engine.close()


def _store(tmp_path: pathlib.Path, host_budget: int | None, device_budget: int = 10**6) -> KVStore:
    device = TierPool("device", device_budget)
    host = TierPool("host", host_budget) if host_budget is not None else None
    return KVStore(3, 2, 4, 2, 4, device, host, SpillDir(tmp_path), torch.device("cpu"))


def test_per_layer_read_is_bitwise_the_whole_gather(tmp_path: pathlib.Path) -> None:
    kv = _store(tmp_path, host_budget=None)
    kv.add_sequence("r")
    kv.append("r", 14)
    torch.manual_seed(0)
    for layer in range(3):
        kv.write("r", layer, 0, torch.randn(2, 14, 4), torch.randn(2, 14, 2))
    whole = [tuple(t.clone() for t in kv.gather("r", layer, 14)) for layer in range(3)]
    strides = kv.gather("r", 1, 14)[0].stride()
    blocks = kv.blocks("r", 1)
    assert kv.spill_cost_fits_host(SpillMode.HOST_FULL) is False  # no host tier: full copies go to disk
    kv.spill_block(blocks[0], SpillMode.DISK_FULL)
    kv.spill_block(blocks[2], SpillMode.DISK_FULL)
    assert blocks[0].device is None and blocks[0].disk is not None

    def stage_off(block, out):
        out.copy_(kv.load(block, Tag.EXACT_LOAD).tensor)

    keys, values = read_layer(kv, "r", 1, 14, stage_off)
    assert torch.equal(keys, whole[1][0]) and torch.equal(values, whole[1][1])
    assert keys.stride() == strides  # the same layout: attention runs the same kernel on it
    kv.free_sequence("r")
    assert kv.spill.num_live_bytes == 0 and kv.device_pool.used_bytes == 0


def test_slot_tensors_grow_and_blocks_follow(tmp_path: pathlib.Path) -> None:
    kv = _store(tmp_path, host_budget=10**6)
    assert kv.device_slots is not None and kv.host_slots is not None
    first = kv.device_slots.num_slots
    kv.add_sequence("r")
    kv.append("r", 4 * (first + 3))  # more blocks per layer than the first capacity
    assert kv.device_slots.num_grown >= 3 and kv.device_slots.num_slots > first
    for layer in range(3):
        kv.write("r", layer, 0, torch.full((2, 4 * (first + 3), 4), float(layer)), torch.ones(2, 4 * (first + 3), 2))
        for block in kv.blocks("r", layer):
            assert block.device.data_ptr() == kv.device_slots.view(layer, block.device_slot).data_ptr()
            assert torch.equal(block.device[..., :4], torch.full((2, 4, 4), float(layer)))
    held = kv.held_device_bytes()["kv_block"]
    assert held == kv.device_pool.used_bytes_by_kind[ObjectKind.KV_BLOCK] == 3 * (first + 3) * kv.bytes_per_block
    kv.free_sequence("r")
    assert all(len(free) == kv.device_slots.tensors[i].shape[1] for i, free in enumerate(kv.device_slots.free_slots))


def test_slot_tier_stops_at_its_budget() -> None:
    tier = SlotTier("device", 1, (1, 2, 2), torch.float32, torch.device("cpu"), 1, 5)
    slots = [tier.take(0) for _ in range(5)]
    assert sorted(slots) == [0, 1, 2, 3, 4]
    with pytest.raises(BudgetError, match="all 5 taken"):
        tier.take(0)


def test_spill_writes_at_offsets_in_few_files_and_reuses_freed_extents(tmp_path: pathlib.Path) -> None:
    spill = SpillDir(tmp_path, segment_bytes=4096)
    records = [spill.write(f"b{i}", torch.full((256,), float(i))) for i in range(10)]  # 1 KiB each
    assert len(spill.paths) == 3 and len({(r.path, r.offset) for r in records}) == 10
    assert {r.offset for r in records} == {0, 1024, 2048, 3072}
    for i, record in enumerate(records):
        assert torch.equal(spill.read(record), torch.full((256,), float(i)))
    size = spill.num_file_bytes
    spill.delete(records[4])
    again = spill.write("again", torch.zeros(256))
    assert (again.path, again.offset) == (records[4].path, records[4].offset) and spill.num_file_bytes == size
    assert spill.num_live_bytes == 10 * 1024
    spill.close()
    assert not spill.root.exists()


def test_spill_is_size_capped(tmp_path: pathlib.Path) -> None:
    spill = SpillDir(tmp_path, max_bytes=3000)
    spill.write("a", torch.zeros(256))
    spill.write("b", torch.zeros(256))
    with pytest.raises(EngineError, match="cap of 3000 B"):
        spill.write("c", torch.zeros(256))
    spill.close()


def test_a_crashed_process_spill_is_removed_on_the_next_start(tmp_path: pathlib.Path) -> None:
    code = (
        "import os, sys, torch\n"
        "from fallbackgate.engine.kv.spill import SpillDir\n"
        "s = SpillDir(sys.argv[1]); s.write('x', torch.zeros(1024)); print(s.root, flush=True); os._exit(0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    stale = pathlib.Path(done.stdout.strip())
    assert stale.exists() and any(stale.glob("seg-*.bin"))  # os._exit: no cleanup ran, as after a crash
    live = SpillDir(tmp_path)  # the next start removes the dead process's directory
    assert live.removed_stale == [stale] and not stale.exists()
    fresh = SpillDir(tmp_path)  # and a live one's directory is never touched by another start
    assert fresh.removed_stale == [] and live.root.exists()
    assert str(os.getpid()) in fresh.root.name
    live.close()
    fresh.close()


def test_max_model_len_flag_and_policy_field_reach_the_engine_config() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    run_command.add_parser(sub)
    args = parser.parse_args(["run", "--max-model-len", "300"])
    policy = policy_from_args(args)
    assert policy.memory.max_model_len == 300
    assert engine_config(policy, run_settings(policy, Overrides()), Overrides()).max_model_len == 300
    exact = Overrides(max_model_len=200)  # a caller's exact override wins
    assert engine_config(policy, run_settings(policy, exact), exact).max_model_len == 200
    with pytest.raises(ValueError, match="--max-model-len must be"):
        run_command.check_args(parser.parse_args(["run", "--max-model-len", "0"]))


def test_max_model_len_is_capped_by_the_model_positions_with_a_clear_message() -> None:
    config = EngineConfig(model_dir=str(CHECKPOINT_DIR), max_model_len=4096, device="cpu")
    engine = Engine(config, ExactLRUController())
    assert engine.max_model_len == 1024  # the bundled model's max_position_embeddings
    with pytest.raises(PromptError, match=r"limit 1024 = min\(max_model_len 4096, max_position_embeddings 1024\)"):
        engine.add_request(list(range(5, 1025)), SamplingParams(max_new_tokens=8))
    engine.close()

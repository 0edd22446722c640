"""Page-locked host expert copies (CUDA's host tier): exact copies in page-aligned mappings of exactly their
page-rounded bytes, counted by the host pool at that footprint, unlocked once each when dropped or at close.
The CUDA runtime's register/unregister are replaced by a ledger of calls here (no GPU on CI); the GPU run is
`.ci/gpu-check`."""

from __future__ import annotations

import gc
import mmap
import pathlib

import pytest
import torch

from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine import pinned_memory as pinned
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.device_pool import Scratch
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.errors import EngineError
from fallbackgate.engine.experts import store
from fallbackgate.engine.experts.weights import BlockScaled, ExpertWeights
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.engine.tags import ObjectKind
from tests.checkpoints import make_checkpoint

PROMPTS = ([5, 17, 33, 9, 101, 250, 7, 64, 12, 3, 88], [44, 2, 190, 31, 6], [9, 9, 14, 200, 3, 71])


class FakeRuntime:
    """Records what cudaHostRegister / cudaHostUnregister would have been asked."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}  # address -> bytes
        self.num_registers = self.num_unregisters = 0

    def register(self, address: int, num_bytes: int) -> None:
        assert address % mmap.PAGESIZE == 0 and num_bytes % mmap.PAGESIZE == 0
        assert all(address >= a + n or address + num_bytes <= a for a, n in self.registered.items()), "overlap"
        self.registered[address] = num_bytes
        self.num_registers += 1

    def unregister(self, address: int) -> None:
        assert address in self.registered, "unregistering memory that is not registered"
        del self.registered[address]
        self.num_unregisters += 1

    def pinner(self) -> pinned.PinnedHostCopies:
        return pinned.PinnedHostCopies(self.register, self.unregister)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_a_pinned_copy_is_bitwise_the_read_in_one_page_aligned_mapping_within_its_footprint(dtype) -> None:
    runtime = FakeRuntime()
    pinner = runtime.pinner()
    held = ExpertWeights(torch.randn(96, 40).to(dtype), torch.randn(40, 48).to(dtype))
    copy = pinner.pin(held)
    assert torch.equal(copy.gate_up, held.gate_up) and torch.equal(copy.down, held.down)
    assert copy.gate_up.dtype == dtype and copy.down.shape == (40, 48)
    address = copy.gate_up.untyped_storage().data_ptr()
    assert list(runtime.registered) == [address] and copy.down.untyped_storage().data_ptr() == address
    assert held.num_bytes < runtime.registered[address] == pinner.num_locked_bytes <= pinned.footprint(held.num_bytes)
    assert pinner.is_pinned(copy) and not pinner.is_pinned(held)
    pinner.unpin(held)  # not a pinned copy: nothing happens
    assert runtime.num_unregisters == 0
    pinner.unpin(copy)
    assert runtime.registered == {} and pinner.num_locked_bytes == 0 and not pinner.is_pinned(copy)
    assert torch.equal(copy.gate_up, held.gate_up), "an unlocked copy stays readable while referenced"


def test_an_fp8_copy_keeps_its_codes_and_scales_and_close_unlocks_every_copy() -> None:
    runtime = FakeRuntime()
    pinner = runtime.pinner()
    codes = torch.randn(64, 32).to(torch.float8_e4m3fn)
    scales = (torch.rand(1, 1), torch.rand(1, 1), torch.rand(1, 1))
    held = BlockScaled(codes, torch.randn(32, 32).to(torch.float8_e4m3fn), scales)
    copies = [pinner.pin(held) for _ in range(3)]
    for copy in copies:
        assert isinstance(copy, BlockScaled)
        assert copy.gate_up.view(torch.uint8).equal(held.gate_up.view(torch.uint8))
        assert all(torch.equal(a, b) for a, b in zip(copy.scales, held.scales, strict=True))
    assert len(runtime.registered) == 3 and pinner.num_locked_bytes <= 3 * pinned.footprint(held.num_bytes)
    pinner.close()
    assert runtime.registered == {} and runtime.num_unregisters == 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_checkpoint("olmoe", tmp_path_factory.mktemp("pin") / "olmoe", dtype=torch.bfloat16)


def _engine(path: pathlib.Path) -> Engine:
    probe = Engine(EngineConfig(model_dir=str(path), block_size=4), ExactLRUController())
    expert, block = probe.expert_store.bytes_per_expert, probe.kv_store.bytes_per_block
    budgets = {
        "device_budget_bytes": 3 * expert + 40 * probe.kv_store.num_layers * block,
        "host_budget_bytes": 6 * pinned.footprint(expert),
        "is_emulated_device_tier": True,
    }
    config = EngineConfig(model_dir=str(path), block_size=4, max_num_seqs=3, **budgets)
    return Engine(config, ExactLRUController())


def test_an_engine_with_pinned_host_copies_gives_the_same_tokens_and_counts_every_locked_byte(
    checkpoint: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = SamplingParams(max_new_tokens=6)
    reference = _engine(checkpoint).generate([list(p) for p in PROMPTS], params)
    runtime = FakeRuntime()
    monkeypatch.setattr(store, "pins_host_copies", lambda layout: True)
    monkeypatch.setattr(store, "PinnedHostCopies", runtime.pinner)
    engine = _engine(checkpoint)
    host_cache = engine.expert_store.host_cache
    assert host_cache.bytes_per_expert == pinned.footprint(engine.expert_store.bytes_per_expert)
    num_warm = sum(e.host is not None for e in engine.expert_store.entries.values())
    # warm-up stops while the pool still has room for the last copy's pageable read beside it
    assert runtime.num_registers == num_warm == 5 and host_cache.num_unpinned == 0
    for sid, prompt in enumerate(PROMPTS):
        engine.add_request(list(prompt), params, request_id=f"r{sid}")
    num_checks = 0
    while engine.has_unfinished():
        engine.step()
        held = [e.host for e in engine.expert_store.entries.values() if e.host is not None]
        num_locked = sum(host_cache.pinner.is_pinned(h) for h in held)
        assert num_locked == len(held) == len(runtime.registered)  # the pool had room: every cached copy locked
        locked = sum(runtime.registered.values())
        assert locked == host_cache.pinner.num_locked_bytes <= num_locked * host_cache.bytes_per_expert
        counted = engine.expert_store.host_pool.used_bytes_by_kind[ObjectKind.EXPERT]
        assert counted == len(held) * host_cache.bytes_per_expert
        num_checks += 1
    outputs = [engine.finished[f"r{i}"] for i in range(len(PROMPTS))]
    for got, want in zip(outputs, reference, strict=True):
        assert got.output_token_ids == want.output_token_ids
        assert torch.equal(got.output_logits, want.output_logits)
    assert runtime.num_unregisters > 0, "the run moved host copies (unlocked as they left)"
    assert host_cache.num_unpinned == 0 and num_checks > 3
    host_pool = engine.expert_store.host_pool
    assert host_pool.peak_bytes_by_kind[Scratch.EXPERT_PIN] == host_cache.bytes_per_expert  # the read beside its copy
    assert host_pool.peak_used_bytes <= host_pool.budget_bytes
    engine.close()
    assert runtime.registered == {} and runtime.num_registers == runtime.num_unregisters


def test_a_refused_lock_leaves_the_copy_pageable_and_a_failed_unlock_loses_no_bookkeeping(
    checkpoint: pathlib.Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    runtime = FakeRuntime()
    calls = {"register": 0}

    def flaky_register(address: int, num_bytes: int) -> None:
        calls["register"] += 1
        if calls["register"] % 3 == 0:
            raise EngineError("cudaHostRegister of 1 host bytes failed with CUDA error 2")
        runtime.register(address, num_bytes)

    def failing_unregister(address: int) -> None:
        runtime.unregister(address)
        if runtime.num_unregisters == 1:
            raise EngineError("cudaHostUnregister failed with CUDA error 1")

    params = SamplingParams(max_new_tokens=6)
    reference = _engine(checkpoint).generate([list(p) for p in PROMPTS], params)
    monkeypatch.setattr(store, "pins_host_copies", lambda layout: True)
    monkeypatch.setattr(store, "PinnedHostCopies", lambda: pinned.PinnedHostCopies(flaky_register, failing_unregister))
    engine = _engine(checkpoint)
    outputs = engine.generate([list(p) for p in PROMPTS], params)
    assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in reference]
    host_cache = engine.expert_store.host_cache
    refused = calls["register"] // 3
    assert refused > 0 and host_cache.num_unpinned == refused
    assert "could not unlock" in caplog.text and "left pageable" in caplog.text
    held = [e.host for e in engine.expert_store.entries.values() if e.host is not None]
    counted = engine.expert_store.host_pool.used_bytes_by_kind[ObjectKind.EXPERT]
    assert counted == len(held) * host_cache.bytes_per_expert  # the failed unlock's copy left the pool too
    engine.close()
    assert runtime.registered == {}


def test_copies_still_locked_when_their_owner_is_dropped_are_unlocked() -> None:
    runtime = FakeRuntime()
    pinner = runtime.pinner()
    copies = [pinner.pin(ExpertWeights(torch.randn(8, 4), torch.randn(4, 4))) for _ in range(2)]
    del pinner
    gc.collect()
    assert runtime.registered == {} and runtime.num_unregisters == 2
    assert all(bool(torch.isfinite(c.gate_up).all()) for c in copies)  # still readable, pageable

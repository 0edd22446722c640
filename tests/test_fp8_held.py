"""FP8 experts held in host memory as the checkpoint stores them (e4m3 codes + fp32 block scales) and
dequantized per expert on use: the host pool reserves exactly those storage bytes, a host exact_load moves
them, and tokens and logits are bitwise those of the former dequantize-on-read path."""

from __future__ import annotations

import pathlib

import pytest
import torch

from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.device_pool import Scratch
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.experts import fp8_experts
from fallbackgate.engine.experts.manifest import weights_digest
from fallbackgate.engine.experts.reader import ExpertReader
from fallbackgate.engine.experts.weights import BlockScaled, ExpertWeights
from fallbackgate.engine.model import fp8
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.engine.tags import ObjectKind, Tag, Tier
from tests.test_bytes_engine import _host_account
from tests.test_fp8 import _fp8_checkpoint

PROMPTS = [[5, 9, 40, 7, 300], [17, 3, 3, 88, 1000, 12, 6, 2000, 31]]


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return _fp8_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def _engine(path: pathlib.Path) -> Engine:
    probe = Engine(EngineConfig(model_dir=str(path), host_budget_bytes=0), ExactLRUController())
    expert, kv = probe.expert_store.place_bytes, probe.kv_store
    held = probe.expert_store.reader.held_bytes_per_expert
    probe.close()
    config = EngineConfig(
        model_dir=str(path),
        max_num_seqs=2,
        device_budget_bytes=3 * expert + 64 * kv.num_layers * kv.bytes_per_block,
        host_budget_bytes=6 * held,  # fewer host copies than experts: hits, evictions and disk reads
        is_emulated_device_tier=True,  # CUDA's device / host / disk layout, emulated in RAM
    )
    return Engine(config, ExactLRUController())


def _run(engine: Engine) -> tuple[list[list[int]], list[torch.Tensor], dict[Tier | None, list[int]]]:
    moved: dict[Tier | None, list[int]] = {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, SamplingParams(max_new_tokens=8), f"r{i}")
    tokens: dict[str, list[int]] = {}
    logits: dict[str, list[torch.Tensor]] = {}
    while engine.has_unfinished():
        result = engine.step()
        for event in result.events:
            if event.tag is Tag.EXACT_LOAD and event.bytes_moved:
                moved.setdefault(event.source_tier, []).append(event.bytes_moved // event.count)
        reserved, held = _host_account(engine)
        assert reserved == held  # the host pool counts the FP8 copies at their storage bytes
        for request_id, token in result.sampled_token_ids.items():
            tokens.setdefault(request_id, []).append(token)
            logits.setdefault(request_id, []).append(result.logits[request_id])
    names = sorted(tokens)
    return [tokens[n] for n in names], [torch.stack(logits[n]) for n in names], moved


def test_fp8_copies_are_held_as_stored_and_counted_at_their_bytes(checkpoint: pathlib.Path) -> None:
    engine = _engine(checkpoint)
    store = engine.expert_store
    reader = store.reader
    held_copies = [e.host for e in store.entries.values() if e.host is not None]
    assert held_copies and all(isinstance(h, BlockScaled) for h in held_copies)
    assert all(h.gate_up.dtype == torch.float8_e4m3fn for h in held_copies)
    assert {h.num_bytes for h in held_copies} == {reader.checkpoint_bytes_per_expert}
    assert store.host_cache.bytes_per_expert == reader.checkpoint_bytes_per_expert
    assert reader.checkpoint_bytes_per_expert < 0.6 * reader.compute_bytes_per_expert  # bf16 compute
    assert (
        store.host_pool.used_bytes_by_kind[ObjectKind.EXPERT] == len(held_copies) * reader.checkpoint_bytes_per_expert
    )
    _, _, moved = _run(engine)
    # exact_load from a host copy moves its codes and scales; from the checkpoint, the files' FP8 bytes
    assert moved[Tier.HOST] and set(moved[Tier.HOST]) == {reader.checkpoint_bytes_per_expert}
    assert moved[Tier.DISK] and set(moved[Tier.DISK]) == {reader.checkpoint_bytes_per_expert}
    assert store.device_pool.peak_bytes_by_kind[Scratch.EXPERT_DEQUANT] == reader.dequant_scratch_bytes > 0
    checks = [engine.verifier.verify_step(0) for _ in range(6)]  # host (FP8) and device (dequantized) copies
    assert {v.tier for step in checks for v in step} == {Tier.HOST, Tier.DEVICE}
    assert all(v.passed for step in checks for v in step)
    engine.close()


def test_fp8_held_tokens_and_logits_equal_dequantize_on_read(
    checkpoint: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    held_tokens, held_logits, _ = _run(engine := _engine(checkpoint))
    engine.close()
    stored = ExpertReader.read_stored

    def dequantized_on_read(self: ExpertReader, key: tuple[int, int]) -> ExpertWeights:
        weights = fp8_experts.to_compute(stored(self, key), self.compute_dtype)
        self.compute_digests[key] = weights_digest(weights)
        return weights

    monkeypatch.setattr(ExpertReader, "read_stored", dequantized_on_read)
    monkeypatch.setattr(ExpertReader, "held_bytes_per_expert", property(lambda self: self.compute_bytes_per_expert))
    on_read = _engine(checkpoint)
    assert all(not isinstance(e.host, BlockScaled) for e in on_read.expert_store.entries.values())
    tokens, logits, _ = _run(on_read)
    on_read.close()
    assert held_tokens == tokens
    assert all(torch.equal(a, b) for a, b in zip(held_logits, logits, strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_into_a_slot_is_the_whole_tensor_dequantization(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    parts = [torch.randn(rows, cols, generator=gen) for rows, cols in ((64, 32), (64, 32), (32, 64))]
    coded = [fp8.quantize_blocks(p, (16, 16)) for p in parts]
    held = BlockScaled(torch.cat([coded[0][0], coded[1][0]]), coded[2][0], tuple(s for _, s in coded))
    slot = ExpertWeights(torch.full((128, 32), float("nan"), dtype=dtype), torch.zeros(32, 64, dtype=dtype))
    fp8_experts.write_into(slot, held)
    whole = [fp8.dequantize(c, s, dtype) for c, s in coded]
    assert torch.equal(slot.gate_up, torch.cat(whole[:2])) and torch.equal(slot.down, whole[2])
    assert held.num_bytes == sum(p.numel() for p in parts) + 4 * sum(s.numel() for _, s in coded)

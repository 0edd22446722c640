"""Block-scaled FP8 checkpoints (as DeepSeek-V3 and Qwen3-FP8 ship): streamed as FP8, dequantized per expert
on read, bitwise what transformers' own dequantization gives, and exact through the engine."""

from __future__ import annotations

import json
import pathlib
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.errors import ChecksumError
from fallbackgate.engine.model import fp8
from fallbackgate.engine.model.checkpoint_files import CheckpointFiles
from fallbackgate.engine.model.loader import load_checkpoint
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.synth.shapes import ALL_NAMES, FP8_BLOCK, resolve
from fallbackgate.synth.writer import build_config, total_bytes, write_checkpoint
from fallbackgate.tinymoe import CHECKPOINT_DIR

BLOCK = (16, 16)  # small shapes tile into 16 × 16 blocks; published checkpoints use 128 × 128
SMALL = {
    "qwen3_moe": dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, max_position_embeddings=512,
        norm_topk_prob=True, tie_word_embeddings=False,
    ),
    "deepseek_v3": dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None,
        kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, num_experts_per_tok=2, n_group=2,
        topk_group=1, max_position_embeddings=512, tie_word_embeddings=False,
    ),
}  # fmt: skip


def _fp8_checkpoint(tmp_path: pathlib.Path, arch: str) -> pathlib.Path:
    bundled = json.loads((CHECKPOINT_DIR / "config.json").read_text())
    out = tmp_path / arch
    write_checkpoint(
        build_config(arch, SMALL[arch], None, bundled), out, torch.bfloat16, CHECKPOINT_DIR, fp8_block=BLOCK
    )
    return out


def _transformers(path: pathlib.Path, dtype: torch.dtype) -> torch.nn.Module:
    with warnings.catch_warnings():  # "FP8 needs a GPU: dequantizing" is the path under test
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(32, 48), (2, 64, 32)])
def test_dequantize_is_transformers_dequantization_bitwise(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    codes = (torch.randn(shape, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.rand((*shape[:-2], shape[-2] // 16, shape[-1] // 16), generator=gen) * 1e-3
    expected = Fp8Dequantize(None)._dequantize_one(codes, scales, output_dtype=dtype)
    got = fp8.dequantize(codes, scales, dtype)
    assert got.dtype == dtype and torch.equal(got, expected)


def test_quantize_then_dequantize_is_close_and_tiles_are_checked() -> None:
    weight = torch.randn(64, 32) * 0.02
    codes, scales = fp8.quantize_blocks(weight, BLOCK)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (4, 2)
    back = fp8.dequantize(codes, scales, torch.float32)
    assert (back - weight).abs().max().item() <= weight.abs().max().item() / 8  # e4m3: 3 mantissa bits
    with pytest.raises(ValueError, match="multiple"):
        fp8.quantize_blocks(torch.zeros(20, 16), BLOCK)


@pytest.mark.parametrize("arch", sorted(SMALL))
def test_fp8_experts_and_dense_weights_equal_transformers_dequantized(tmp_path: pathlib.Path, arch: str) -> None:
    path = _fp8_checkpoint(tmp_path, arch)
    files = CheckpointFiles(path)
    assert files.dtype("model.layers.1.mlp.experts.0.gate_proj.weight") == torch.float8_e4m3fn
    loaded = load_checkpoint(path)
    assert loaded.dtype == torch.bfloat16 and loaded.checkpoint_dtype == torch.float8_e4m3fn
    reader = loaded.reader
    assert reader.is_block_scaled
    num_params = reader.num_params_per_expert
    num_scales = num_params // (BLOCK[0] * BLOCK[1])
    assert reader.checkpoint_bytes_per_expert == num_params + 4 * num_scales  # 1 B codes + fp32 scales
    assert reader.compute_bytes_per_expert == 2 * num_params
    state = _transformers(path, torch.bfloat16).state_dict()
    for (layer, expert), _ in sorted(reader.sources.items()):
        weights = reader.read((layer, expert))
        prefix = f"model.layers.{layer}.mlp.experts"
        assert torch.equal(weights.gate_up, state[f"{prefix}.gate_up_proj"][expert]), (layer, expert)
        assert torch.equal(weights.down, state[f"{prefix}.down_proj"][expert]), (layer, expert)
    dense = {n: p for n, p in loaded.model.named_parameters() if p.numel()}
    assert any("self_attn" in n for n in dense)
    for name, param in dense.items():
        assert torch.equal(param, state[name]), name


def test_engine_on_fp8_is_exact_against_transformers_with_and_without_a_budget(tmp_path: pathlib.Path) -> None:
    path = _fp8_checkpoint(tmp_path, "qwen3_moe")
    prompts = [[5, 9, 40, 7, 300], [17, 3, 3, 88, 1000, 12, 6, 2000, 31]]
    model = _transformers(path, torch.float32)
    with torch.no_grad():
        ref = [model.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False) for p in prompts]
    expected = [r[0, len(p) :].tolist() for r, p in zip(ref, prompts, strict=True)]
    probe = Engine(EngineConfig(model_dir=str(path), dtype="float32"), ExactLRUController())
    budget = 4 * probe.expert_store.bytes_per_expert + 64 * probe.kv_store.num_layers * probe.kv_store.bytes_per_block
    for knobs in ({}, {"device_budget_bytes": budget, "host_budget_bytes": 0}):
        engine = Engine(EngineConfig(model_dir=str(path), dtype="float32", **knobs), ExactLRUController())
        outputs = engine.generate(prompts, SamplingParams(max_new_tokens=8))
        assert [o.output_token_ids for o in outputs] == expected, knobs
        if knobs:
            assert sum(o.tag_counts.get("exact_load", 0) for o in outputs) > 10
        checks = [engine.verifier.verify_step(0) for _ in range(5)]  # sampled copies against their verified reads
        assert checks[0] and all(v.passed for step in checks for v in step)


def test_verify_checks_fp8_codes_and_scales(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    from fallbackgate.cli import main

    path = _fp8_checkpoint(tmp_path, "deepseek_v3")
    assert main(["verify", "--model", str(path), "--check", "--quiet"]) == 0
    assert "8 of 8 experts match" in capsys.readouterr().out


def test_a_changed_scale_is_caught_as_a_checksum_failure(tmp_path: pathlib.Path) -> None:
    path = _fp8_checkpoint(tmp_path, "qwen3_moe")
    files = CheckpointFiles(path)
    name = "model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"
    file, offset, _ = files.byte_range(name, None)
    with open(file, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0x40]))
    reader = load_checkpoint(path).reader
    reader.read((1, 1))
    with pytest.raises(ChecksumError, match=r"expert \(1, 2\)"):
        reader.read((1, 2))


def test_synth_names_have_fp8_variants_at_half_the_bytes() -> None:
    assert "qwen3-30b-a3b-fp8" in ALL_NAMES and "deepseek-v3-fp8" in ALL_NAMES
    model_type, fields, block = resolve("qwen3-30b-a3b-fp8")  # type: ignore[misc]
    assert block == FP8_BLOCK and resolve("nope-fp8") is None
    config = build_config(model_type, fields, None, None)
    ratio = total_bytes(config, torch.bfloat16, block) / total_bytes(config, torch.bfloat16)
    assert 0.5 < ratio < 0.52  # codes at 1 B; embeddings, head, routers and norms still bf16

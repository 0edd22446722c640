"""Write a random-weight checkpoint with a published model's shapes, shard by shard, never whole in memory.

Tensors are named as published checkpoints name them (dense weights as transformers names its parameters;
routed experts one tensor per matrix: ``experts.E.gate_proj/up_proj/down_proj.weight``, Mixtral's
``w1/w3/w2``), so transformers' own ``from_pretrained`` loads the result. With an FP8 block every linear
weight but the embeddings, the head and the routers is stored block-scaled e4m3 with its ``weight_scale_inv``
and the config carries the ``quantization_config`` DeepSeek-V3 and Qwen3-FP8 publish. The expert manifest's digests are
taken from the generated tensors themselves, never by reading the files back.
"""

from __future__ import annotations

import json
import pathlib
import shutil
from collections.abc import Callable, Iterator

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from fallbackgate.engine.experts.manifest import weights_digest, write_manifest
from fallbackgate.engine.experts.sources import map_experts
from fallbackgate.engine.experts.weights import ExpertWeights
from fallbackgate.engine.model import fp8
from fallbackgate.engine.model.checkpoint_files import INDEX_FILE, CheckpointFiles
from fallbackgate.engine.model.loader import find_experts_modules

INIT_STD = 0.02
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # the --dtype names
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2")}
_DEFAULT_NAMES = ("gate_proj", "up_proj", "down_proj")


class SynthError(ValueError):
    """A synth request that cannot be met (unknown name, not enough disk)."""


def build_config(
    model_type: str, fields: dict, num_layers: int | None, tokenizer_config: dict | None
) -> PretrainedConfig:
    """The published config, optionally with fewer layers, or with the vocabulary and special token ids of
    `tokenizer_config` (a config.json whose tokenizer the checkpoint will carry)."""
    fields = dict(fields)
    if num_layers is not None:
        fields["num_hidden_layers"] = num_layers
    if tokenizer_config is not None:
        for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"):
            fields[key] = tokenizer_config.get(key)
    return AutoConfig.for_model(model_type, **fields)


def planned_tensors(config: PretrainedConfig) -> tuple[list[tuple[str, tuple[int, ...]]], dict[int, tuple[int, ...]]]:
    """(dense tensor names and shapes in layer order, layer -> fused gate_up shape [E, 2I, H])."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    experts = find_experts_modules(model)
    dense = [
        (name, tuple(p.shape))
        for name, p in model.state_dict().items()
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj"))
        and not (config.tie_word_embeddings and name == "lm_head.weight")
    ]
    return dense, {layer: tuple(m.gate_up_proj.shape) for layer, m in experts.items()}


def total_bytes(config: PretrainedConfig, dtype: torch.dtype, fp8_block: tuple[int, int] | None = None) -> int:
    """Bytes of every tensor the checkpoint will hold."""
    dense, experts = planned_tensors(config)
    shapes = [(name, shape) for name, shape in dense]
    for e, two_i, h in experts.values():
        shapes += [("experts.w.weight", (two_i // 2, h))] * (2 * e) + [("experts.w.weight", (h, two_i // 2))] * e
    total = 0
    for name, shape in shapes:
        if _is_fp8_stored(name, shape, fp8_block):
            assert fp8_block is not None
            total += _numel(shape) + 4 * (shape[0] // fp8_block[0]) * (shape[1] // fp8_block[1])
        else:
            total += _numel(shape) * dtype.itemsize
    return total


def _is_fp8_stored(name: str, shape: tuple[int, ...], fp8_block: tuple[int, int] | None) -> bool:
    """Linear weights other than embeddings, head and routers, when they tile into FP8 blocks."""
    if fp8_block is None or len(shape) != 2 or not name.endswith(".weight"):
        return False
    if any(part in name for part in ("embed_tokens", "lm_head", "norm")) or name.endswith("mlp.gate.weight"):
        return False
    return shape[0] % fp8_block[0] == 0 and shape[1] % fp8_block[1] == 0


def _numel(shape: tuple[int, ...]) -> int:
    size = 1
    for dim in shape:
        size *= dim
    return size


def _random(shape: tuple[int, ...], name: str, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if "norm" in name or name.endswith("bias"):
        return torch.ones(shape, dtype=dtype) if "norm" in name else torch.zeros(shape, dtype=dtype)
    return (torch.randn(shape, generator=gen) * INIT_STD).to(dtype)


def _layer_of(name: str) -> int:
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts else -1


def _stored(name: str, tensor: torch.Tensor, fp8_block: tuple[int, int] | None) -> list[tuple[str, torch.Tensor]]:
    if not _is_fp8_stored(name, tuple(tensor.shape), fp8_block):
        return [(name, tensor)]
    assert fp8_block is not None
    codes, scales = fp8.quantize_blocks(tensor, fp8_block)
    return [(name, codes), (fp8.scale_name(name), scales)]


def _tensors(
    config: PretrainedConfig,
    dtype: torch.dtype,
    gen: torch.Generator,
    digests: dict,
    fp8_block: tuple[int, int] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    dense, experts = planned_tensors(config)
    gate_name, up_name, down_name = _EXPERT_NAMES.get(config.model_type, _DEFAULT_NAMES)
    by_layer: dict[int, list[tuple[str, tuple[int, ...]]]] = {}
    for name, shape in dense:
        by_layer.setdefault(_layer_of(name), []).append((name, shape))
    for layer in sorted(by_layer):
        for name, shape in by_layer[layer]:
            yield from _stored(name, _random(shape, name, dtype, gen), fp8_block)
        if layer not in experts:
            continue
        num_experts, two_i, hidden = experts[layer]
        prefix = f"model.layers.{layer}.mlp.experts"
        for e in range(num_experts):
            gate = _random((two_i // 2, hidden), "w", dtype, gen)
            up = _random((two_i // 2, hidden), "w", dtype, gen)
            down = _random((hidden, two_i // 2), "w", dtype, gen)
            stored = [
                _stored(f"{prefix}.{e}.{role}.weight", tensor, fp8_block)
                for role, tensor in ((gate_name, gate), (up_name, up), (down_name, down))
            ]
            (gate, *gate_scale), (up, *up_scale), (down, *down_scale) = ([t for _, t in s] for s in stored)
            scales = (*gate_scale, *up_scale, *down_scale)
            digests[(layer, e)] = weights_digest(
                ExpertWeights(torch.cat([gate.view(torch.uint8), up.view(torch.uint8)]), down), scales
            )
            for pieces in stored:
                yield from pieces


def check_disk(
    config: PretrainedConfig, dtype: torch.dtype, out: pathlib.Path, fp8_block: tuple[int, int] | None = None
) -> int:
    """The bytes the checkpoint needs; SynthError when the disk under `out` has less free (2 % margin)."""
    needed = total_bytes(config, dtype, fp8_block)
    existing = next(p for p in (out, *out.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    if needed * 1.02 + (64 << 20) > free:
        raise SynthError(f"--out {out}: needs {needed / 1e9:.1f} GB, only {free / 1e9:.1f} GB free")
    return needed


def write_checkpoint(
    config: PretrainedConfig,
    out: pathlib.Path,
    dtype: torch.dtype,
    tokenizer_dir: pathlib.Path,
    shard_bytes: int = 2 << 30,
    seed: int = 0,
    on_bytes: Callable[[int], None] | None = None,
    fp8_block: tuple[int, int] | None = None,
) -> int:
    """Write config, shards, index, manifest and tokenizer into `out`; returns the bytes of weights.

    With `fp8_block` (e.g. (128, 128)) linear weights are stored block-scaled FP8 and `dtype` is the
    compute dtype the config names."""
    check_disk(config, dtype, out, fp8_block)
    if fp8_block is not None:
        config.quantization_config = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(fp8_block),
        }
    out.mkdir(parents=True, exist_ok=True)
    gen, digests = torch.Generator().manual_seed(seed), {}
    shards: list[list[str]] = [[]]
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = written = 0
    for name, tensor in _tensors(config, dtype, gen, digests, fp8_block):
        pending[name] = tensor
        pending_bytes += tensor.numel() * tensor.element_size()
        if pending_bytes >= shard_bytes:
            written += _flush(out, len(shards), pending, shards, on_bytes)
            pending, pending_bytes = {}, 0
    if pending:
        written += _flush(out, len(shards), pending, shards, on_bytes)
    _finish(out, config, dtype, shards[1:], tokenizer_dir)
    write_manifest(out, digests, map_experts(CheckpointFiles(out)))
    return written


def _flush(
    out: pathlib.Path,
    number: int,
    tensors: dict[str, torch.Tensor],
    shards: list[list[str]],
    on_bytes: Callable[[int], None] | None,
) -> int:
    save_file(tensors, str(out / f"shard-{number:05d}.tmp"), metadata={"format": "pt"})
    shards.append(list(tensors))
    num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    if on_bytes is not None:
        on_bytes(num_bytes)
    return num_bytes


def _finish(
    out: pathlib.Path,
    config: PretrainedConfig,
    dtype: torch.dtype,
    shards: list[list[str]],
    tokenizer_dir: pathlib.Path,
) -> None:
    weight_map, total = {}, len(shards)
    for number, names in enumerate(shards, start=1):
        final = f"model-{number:05d}-of-{total:05d}.safetensors"
        (out / f"shard-{number:05d}.tmp").replace(out / final)
        weight_map |= dict.fromkeys(names, final)
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    config.dtype = dtype
    config.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out / name)

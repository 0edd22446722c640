"""Dense (non-expert) weights from the checkpoint files into a model built on the meta device.

Checkpoint names are mapped to the model's with transformers' own renamings for the model type (e.g.
Mixtral's ``block_sparse_moe`` -> ``mlp``); dtypes follow transformers' rules (the compute dtype, with the
model's ``_keep_in_fp32_modules_strict`` kept in fp32 for bf16/fp16); a block-scaled FP8 weight is
dequantized with its ``weight_scale_inv`` as transformers dequantizes it. Non-persistent buffers (rotary
frequencies) are recomputed by the model's own initialiser. Anything left on meta is a missing tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import xxhash
from transformers import PreTrainedModel

from fallbackgate.engine.errors import CheckpointError
from fallbackgate.engine.experts.sources import is_expert_tensor
from fallbackgate.engine.model import fp8
from fallbackgate.engine.model.checkpoint_files import CheckpointFiles


def _renamer(model_type: str) -> Callable[[str], str]:
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming

        renamings = [r for r in get_checkpoint_conversion_mapping(model_type) or [] if isinstance(r, WeightRenaming)]
    except ImportError:  # older or newer transformers without this module: names are taken as they are
        renamings = []
    pairs = [(re.compile(s), t) for r in renamings for s, t in zip(r.source_patterns, r.target_patterns, strict=False)]

    def rename(name: str) -> str:
        for source, target in pairs:
            name = source.sub(target, name)
        return name

    return rename


def _owner(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (model.get_submodule(path) if path else model), leaf


def _target_dtype(model: PreTrainedModel, name: str, tensor: torch.Tensor, compute: torch.dtype) -> torch.dtype:
    if not tensor.is_floating_point():
        return tensor.dtype
    plan = model._get_dtype_plan(compute) if hasattr(model, "_get_dtype_plan") else {}
    return next((dtype for pattern, dtype in plan.items() if pattern in name), compute)


def load_dense_weights(model: PreTrainedModel, files: CheckpointFiles, compute: torch.dtype) -> dict[str, str]:
    """Load every non-expert tensor of `files` into `model`; returns the xxh3-64 of each as assigned (model
    name -> digest of its bytes after the dtype cast), which audits check the live weights against."""
    rename = _renamer(str(model.config.model_type))
    expected = {n: p for n, p in model.named_parameters(remove_duplicate=False)} | dict(model.named_buffers())
    digests: dict[str, str] = {}
    for source in files.names():
        if is_expert_tensor(source) or fp8.is_scale_tensor(source):
            continue
        name = rename(source)
        if name not in expected:
            continue  # e.g. a stale rotary buffer in an old checkpoint, as transformers ignores it
        tensor = files.read(source)
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{files.file_of(source)}: tensor {source} has shape {tuple(tensor.shape)}, the model expects "
                f"{tuple(expected[name].shape)} for {name}"
            )
        if fp8.is_fp8(tensor.dtype):
            tensor = _dequantized(files, source, tensor, _target_dtype(model, name, expected[name], compute))
        else:
            tensor = tensor.to(_target_dtype(model, name, tensor, compute))
        module, leaf = _owner(model, name)
        if leaf in module._parameters:
            module._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=False)
        else:
            module._buffers[leaf] = tensor
        digests[name] = tensor_digest(tensor)
    _recompute_non_persistent_buffers(model)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta] + [n for n, b in model.named_buffers() if b.is_meta]
    if missing:
        raise CheckpointError(f"{files.path}: tensor(s) missing from the checkpoint: {', '.join(missing[:5])}")
    return digests


def _dequantized(files: CheckpointFiles, source: str, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    scales = fp8.scale_name(source)
    if scales not in files.file_by_tensor:
        raise CheckpointError(f"{files.file_of(source)}: FP8 tensor {source} has no {scales} beside it")
    try:
        return fp8.dequantize(codes, files.read(scales), dtype, source)
    except CheckpointError as exc:
        raise CheckpointError(f"{files.file_of(source)}: {exc}") from None


def tensor_digest(tensor: torch.Tensor) -> str:
    """xxh3-64 (hex) of a tensor's bytes in its dtype."""
    return xxhash.xxh3_64(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy()).hexdigest()


def _recompute_non_persistent_buffers(model: PreTrainedModel) -> None:
    for module in model.modules():
        meta = [n for n in module._non_persistent_buffers_set if module._buffers.get(n) is not None]
        meta = [n for n in meta if module._buffers[n].is_meta]
        if not meta:
            continue
        for name in meta:
            module._buffers[name] = torch.empty_like(module._buffers[name], device="cpu")
        if any(True for _ in module.parameters(recurse=False)):
            raise CheckpointError(f"{type(module).__name__}: cannot recompute buffers {meta} beside loaded weights")
        model._init_weights(module)

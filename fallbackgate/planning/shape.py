"""A checkpoint's shape for planning, from config.json and the safetensors headers only (no weight read)."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

from fallbackgate.engine.errors import CheckpointError
from fallbackgate.engine.experts.sources import is_expert_tensor, map_experts
from fallbackgate.engine.model.checkpoint_files import CheckpointFiles


@dataclasses.dataclass(frozen=True, slots=True)
class ModelShape:
    """What planning needs to know about a model."""

    name: str  # the directory name
    num_layers: int  # decoder layers
    num_moe_layers: int  # layers with routed experts
    num_experts: int  # routed experts per MoE layer
    top_k: int  # experts per token
    num_params_per_expert: int
    expert_bytes: int  # one expert in the checkpoint's dtype
    num_dense_params: int  # everything but routed experts (embeddings, attention, shared experts, head)
    dense_bytes: int
    kv_bytes_per_token: int  # K and V of one token in one layer, in the checkpoint's dtype
    num_heads: int
    head_dim: int
    dtype: str  # the routed experts' dtype in the files

    @property
    def num_experts_total(self) -> int:
        return self.num_moe_layers * self.num_experts


def _kv_bytes_per_token(config: dict, itemsize: int) -> tuple[int, int, int]:
    """(K+V bytes per token per layer as the engine caches them, heads, head dim)."""
    heads = int(config["num_attention_heads"])
    if config.get("kv_lora_rank"):  # MLA caches the compressed latent and the rotary key
        latent = int(config["kv_lora_rank"]) + int(config.get("qk_rope_head_dim", 0))
        head_dim = int(config.get("qk_nope_head_dim", 0)) + int(config.get("qk_rope_head_dim", 0))
        return latent * itemsize, heads, head_dim
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return 2 * kv_heads * head_dim * itemsize, heads, head_dim


def model_shape(model_dir: str | pathlib.Path) -> ModelShape:
    """Read the shape of the checkpoint at `model_dir` (config and safetensors headers)."""
    path = pathlib.Path(model_dir)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path}: no config.json (is this a checkpoint directory?)")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_file}: not JSON: {exc}") from exc
    files = CheckpointFiles(path)
    sources = map_experts(files)
    if not sources:
        raise CheckpointError(f"{path}: no routed-expert tensors")
    layers = sorted({layer for layer, _ in sources})
    key = next(iter(sources))
    num_params = sum(math.prod(files.shape(n)[1:] if i is not None else files.shape(n)) for n, i in sources[key].parts)
    itemsize = files.element_size(sources[key].parts[0][0])
    dense = [n for n in files.names() if not is_expert_tensor(n)]
    num_dense = sum(math.prod(files.shape(n)) for n in dense)
    dense_bytes = sum(math.prod(files.shape(n)) * files.element_size(n) for n in dense)
    kv, heads, head_dim = _kv_bytes_per_token(config, itemsize)
    top_k = int(config.get("num_experts_per_tok") or config.get("moe_topk") or 1)
    return ModelShape(
        name=path.name,
        num_layers=int(config["num_hidden_layers"]),
        num_moe_layers=len(layers),
        num_experts=len(sources) // len(layers),
        top_k=top_k,
        num_params_per_expert=num_params,
        expert_bytes=num_params * itemsize,
        num_dense_params=num_dense,
        dense_bytes=dense_bytes,
        kv_bytes_per_token=kv,
        num_heads=heads,
        head_dim=head_dim,
        dtype=str(files.dtype(sources[key].parts[0][0])).removeprefix("torch."),
    )

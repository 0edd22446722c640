"""Builds the engine's parts from a checkpoint: shapes probe, pools, stores, minimum budget."""

from __future__ import annotations

import dataclasses
import tempfile

import torch
from transformers import DynamicCache

from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.device_pool import TierPool
from fallbackgate.engine.errors import BudgetError, CheckpointError
from fallbackgate.engine.expert_store import ExpertStore
from fallbackgate.engine.kv_store import KVStore
from fallbackgate.engine.loader import LoadedCheckpoint
from fallbackgate.engine.spill import SpillDir

MIB = 1024 * 1024


@dataclasses.dataclass(slots=True)
class KVShape:
    """What one token's cache entry looks like in every layer."""

    num_layers: int
    num_kv_heads: int
    key_dim: int
    value_dim: int


def probe_kv_shapes(loaded: LoadedCheckpoint) -> KVShape:
    """Run one token through transformers' own eager path and read the cache shapes per layer."""
    model = loaded.model
    saved = model.config._experts_implementation
    model.config._experts_implementation = "eager"
    try:
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([[0]]), cache=DynamicCache(config=model.config), use_cache=True)
    finally:
        model.config._experts_implementation = saved
    layers = out.cache.layers
    shapes = {(layer.keys.shape[1], layer.keys.shape[-1], layer.values.shape[-1]) for layer in layers}
    if len(shapes) != 1 or any(getattr(layer, "is_sliding", False) for layer in layers):
        raise CheckpointError(f"{loaded.path}: layers with different or sliding-window caches are not supported yet")
    heads, key_dim, value_dim = shapes.pop()
    return KVShape(len(layers), int(heads), int(key_dim), int(value_dim))


def resolve_device(name: str) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def build_stores(
    config: EngineConfig, loaded: LoadedCheckpoint, shape: KVShape, device: torch.device
) -> tuple[ExpertStore, KVStore, int]:
    """Pools, the expert store (experts leave the modules) and the KV store; returns the expert floor."""
    first = next(iter(loaded.experts_by_layer.values()))
    expert_bytes = (first.gate_up_proj[0].numel() + first.down_proj[0].numel()) * 4
    block_bytes = shape.num_kv_heads * config.block_size * (shape.key_dim + shape.value_dim) * 4
    num_experts_total = sum(m.num_experts for m in loaded.experts_by_layer.values())
    kv_everything = (
        shape.num_layers * config.max_num_seqs * (config.max_model_len // config.block_size + 1) * block_bytes
    )
    device_budget = config.device_budget_bytes
    if device_budget is None:
        device_budget = num_experts_total * expert_bytes + kv_everything
    expert_floor = loaded.top_k * expert_bytes
    minimum = expert_floor + shape.num_layers * block_bytes
    if device_budget < minimum:
        raise BudgetError(
            f"device budget {device_budget / MIB:.3f} MiB cannot make progress: the minimum is {minimum / MIB:.3f} MiB "
            f"({loaded.top_k} experts × {expert_bytes} B for one layer's top-k, plus one {block_bytes} B KV block "
            f"per layer × {shape.num_layers} layers for one running request)"
        )
    host_budget = config.host_budget_bytes
    if host_budget is None:
        host_budget = 2 * num_experts_total * expert_bytes + 2 * kv_everything
    device_pool, host_pool = TierPool("device", device_budget), TierPool("host", host_budget)
    spill = SpillDir(config.spill_dir or tempfile.gettempdir())
    expert_store = ExpertStore(
        loaded.experts_by_layer, device_pool, host_pool, spill, device, config.expert_lowbit_bits
    )
    kv_store = KVStore(
        shape.num_layers,
        shape.num_kv_heads,
        shape.key_dim,
        shape.value_dim,
        config.block_size,
        device_pool,
        host_pool,
        spill,
        device,
    )
    return expert_store, kv_store, expert_floor

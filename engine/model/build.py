"""Builds the engine's parts from a checkpoint: shapes probe, pools, stores, minimum budget."""

from __future__ import annotations

import dataclasses
import pathlib
import tempfile

import torch
from transformers import DynamicCache
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from fallbackgate.engine.config import EngineConfig, TierLayout, tier_layout
from fallbackgate.engine.device_pool import TierPool
from fallbackgate.engine.errors import BudgetError, CheckpointError
from fallbackgate.engine.experts.lowbit_cache import LowbitDiskCache, manifest_hash
from fallbackgate.engine.experts.manifest import MANIFEST_FILE
from fallbackgate.engine.experts.store import ExpertStore
from fallbackgate.engine.kv.spill import SpillDir
from fallbackgate.engine.kv.store import KVStore
from fallbackgate.engine.model.loader import LoadedCheckpoint
from fallbackgate.engine.ram import size_ram_budget

MIB = 1024 * 1024
PROBE_IMPLEMENTATION = "fallbackgate_shape_probe"


@dataclasses.dataclass(slots=True)
class KVShape:
    """What one token's cache entry looks like in every layer."""

    num_layers: int
    num_kv_heads: int
    key_dim: int
    value_dim: int


def _no_experts(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    return torch.zeros_like(hidden_states)


def probe_kv_shapes(loaded: LoadedCheckpoint) -> KVShape:
    """Run one token through the dense weights (experts contribute zeros) and read what attention cached.

    The geometry comes from the K/V tensors attention really cached, not from the config (MLA attention
    caches the compressed latent and the shared positional key, one "head", and expands them to every head
    only after the cache read: see `engine/kv/paged_attention.py`); no routed expert is read.
    """
    model = loaded.model
    ALL_EXPERTS_FUNCTIONS.register(PROBE_IMPLEMENTATION, _no_experts)
    saved = model.config._experts_implementation
    model.config._experts_implementation = PROBE_IMPLEMENTATION
    try:
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([[0]]), cache=DynamicCache(config=model.config), use_cache=True)
    except Exception as exc:  # an attention or cache layout the engine cannot page
        raise CheckpointError(f"{loaded.path}: the engine cannot serve this architecture's attention: {exc}") from exc
    finally:
        model.config._experts_implementation = saved
    layers = out.cache.layers
    shapes = {(layer.keys.shape[1], layer.keys.shape[-1], layer.values.shape[-1]) for layer in layers}
    if len(shapes) != 1 or any(getattr(layer, "is_sliding", False) for layer in layers):
        raise CheckpointError(f"{loaded.path}: layers with different or sliding-window caches are not supported yet")
    heads, key_dim, value_dim = shapes.pop()
    return KVShape(len(layers), int(heads), int(key_dim), int(value_dim))


def can_stack(modules: dict[int, torch.nn.Module]) -> bool:
    """Whether every experts module computes as transformers' grouped_mm path expects of stacked weights:
    gated, [E, out, in] layout, no biases, no post-expert norm."""
    return all(
        getattr(m, "has_gate", False)
        and not getattr(m, "is_transposed", False)
        and not getattr(m, "has_bias", False)
        and not getattr(m, "has_post_expert_norm", False)
        for m in modules.values()
    )


def fill_expert_tiers(config: EngineConfig, loaded: LoadedCheckpoint, store: ExpertStore, budgets: Budgets) -> None:
    """Everything fits (no device budget given, and the budget holds every expert and every KV block): stack
    each layer's experts on the device; otherwise warm the host cache the way a fresh process would fill it
    (none on a CPU, where there is no host tier: experts are read from disk on first use)."""
    is_fit = config.device_budget_bytes is None and budgets.is_everything_fitting
    if is_fit and config.is_stacked_when_fits and can_stack(loaded.experts_by_layer):
        store.stack_layers(loaded.experts_by_layer)
    else:
        store.warm_host()


def resolve_device(name: str) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


@dataclasses.dataclass(slots=True)
class Budgets:
    """The byte budgets of the pools, and how they were set."""

    device_bytes: int  # the device pool (on a CPU: RAM, the one fast tier)
    host_bytes: int  # the host pool (0 on a CPU: no second RAM tier)
    note: str  # one line for the run summary
    is_everything_fitting: bool = True  # the device budget holds every expert, every KV block and the gather


def size_budgets(
    config: EngineConfig,
    layout: TierLayout,
    expert_total: int,
    kv_everything: int,
    everything_bytes: int,
    dense_bytes: int,
) -> Budgets:
    """Device and host budgets: given ones, else on a CPU the memory limit minus dense weights and a margin
    (engine/ram.py), else (CUDA, the emulation) everything on device and a host cache of every expert's full
    and low-bit copy and twice the KV."""
    name = "RAM" if layout is TierLayout.RAM_DISK else "device"
    if layout is TierLayout.RAM_DISK:
        if config.host_budget_bytes:
            raise BudgetError(
                f"a host budget ({config.host_budget_bytes / MIB:.3f} MiB) is not offered where the device is the "
                "CPU: RAM is the one fast tier, under one budget (the device budget); the disk is the other"
            )
        if config.device_budget_bytes is not None:
            given = config.device_budget_bytes
            return Budgets(given, 0, f"RAM budget {given / MIB:.2f} MiB (given)")
        sized = size_ram_budget(dense_bytes)
        return Budgets(sized.budget_bytes, 0, sized.describe())
    device = config.device_budget_bytes
    how = "given" if device is not None else "everything fits"
    note = f"{name} budget {(everything_bytes if device is None else device) / MIB:.2f} MiB ({how})"
    host = config.host_budget_bytes
    if host is None:  # every expert cached once, its low-bit copy, and KV copies
        host = 2 * expert_total + 2 * kv_everything
    if layout is TierLayout.EMULATED_DEVICE_HOST_DISK:
        note += f"; EMULATED device/host tiers in RAM (test only), host budget {host / MIB:.2f} MiB"
    return Budgets(everything_bytes if device is None else device, host, note)


def _attach_lowbit_cache(config: EngineConfig, loaded: LoadedCheckpoint, expert_store: ExpertStore) -> None:
    """The persisted low-bit copies on disk (filled now when the config says they are prepared)."""
    expert_store.lowbit_cache = LowbitDiskCache(
        pathlib.Path(config.lowbit_cache_dir),
        manifest_hash(loaded.reader.files.path / MANIFEST_FILE),
        config.expert_lowbit_bits,
        loaded.reader.matrix_shapes,
        config.lowbit_cache_bytes,
        loaded.reader.compute_dtype,
    )
    if config.is_lowbit_prepared:  # before serving: these reads are no step's
        expert_store.lowbit_cache.fill(list(expert_store.entries), loaded.reader.read, progress=True)


def build_stores(
    config: EngineConfig, loaded: LoadedCheckpoint, shape: KVShape, device: torch.device, dense_bytes: int = 0
) -> tuple[ExpertStore, KVStore, int, Budgets]:
    """Pools, the expert store (experts leave the modules) and the KV store; returns the expert floor and the
    budgets. On a CPU the KV store gets the one RAM pool as its device pool and a zero-budget host pool."""
    layout = tier_layout(device, config.is_emulated_device_tier)
    expert_bytes = loaded.reader.compute_bytes_per_expert
    block_bytes = shape.num_kv_heads * config.block_size * (shape.key_dim + shape.value_dim) * loaded.dtype.itemsize
    num_experts_total = len(loaded.reader.sources)
    kv_everything = (
        shape.num_layers * config.max_num_seqs * (config.max_model_len // config.block_size + 1) * block_bytes
    )
    # every expert, every block, and one layer's gathered K/V (blocks, then packed)
    everything = num_experts_total * expert_bytes + kv_everything + 2 * kv_everything // shape.num_layers
    budgets = size_budgets(config, layout, num_experts_total * expert_bytes, kv_everything, everything, dense_bytes)
    budgets.is_everything_fitting = budgets.device_bytes >= everything
    expert_floor = loaded.top_k * expert_bytes
    minimum = expert_floor + shape.num_layers * block_bytes
    if budgets.device_bytes < minimum:
        raise BudgetError(
            f"{budgets.note}: cannot make progress: the minimum is {minimum / MIB:.3f} MiB "
            f"({loaded.top_k} experts × {expert_bytes} B for one layer's top-k, plus one {block_bytes} B KV block "
            f"per layer × {shape.num_layers} layers for one running request)"
        )
    device_pool = TierPool("RAM" if layout is TierLayout.RAM_DISK else "device", budgets.device_bytes)
    host_pool = TierPool("host", budgets.host_bytes)
    spill = SpillDir(config.spill_dir or tempfile.gettempdir())
    expert_store = ExpertStore(
        loaded.reader, device_pool, host_pool, device, config.expert_lowbit_bits, config.num_io_threads, layout
    )
    if config.lowbit_cache_dir and layout is TierLayout.RAM_DISK and config.expert_lowbit_bits:
        _attach_lowbit_cache(config, loaded, expert_store)
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
        loaded.dtype,
    )
    kv_store.write_behind_pool = device_pool if layout is TierLayout.RAM_DISK else host_pool  # the RAM's budget
    return expert_store, kv_store, expert_floor, budgets

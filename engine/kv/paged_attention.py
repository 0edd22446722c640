"""Attention per request over the engine's paged KV, registered with transformers' attention interface.

The paged cache hands each layer's K/V to the executor request by request; this attention function then
runs transformers' own SDPA attention once per request of the packed forward, over that request's K/V
alone: no mask across requests (transformers builds none for an attention implementation it has no mask
function for), no copy of every request's K/V into one tensor, cost linear in the total KV. Each request
sees exactly what a single-sequence forward would: no mask when it starts at position 0 (causal) or
decodes one token, else a causal mask offset by its cached length. Outside an engine step (the exact
baseline, the shape probe) it is plain SDPA attention over the given K/V, causal and offset by the cached
length when a chunk follows cached positions. Attention modules that expand
cached latents after the cache read (MLA's ``expand_kv``) expand each request's latents here, one request
at a time: the expanded K/V (`expanded_kv_bytes`) are per-layer staging, counted in the device pool as
Scratch.KV_EXPAND (room made first, as for any buffer) until that request's attention has run, so the
peak stays under the budget however long the context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from fallbackgate.engine.device_pool import Scratch
from fallbackgate.engine.model import compiled_ops

if TYPE_CHECKING:
    from fallbackgate.engine.experts.executor import Executor

ATTENTION_IMPLEMENTATION = "fallbackgate_paged"


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """[1, H, T, D] packed queries -> [1, T, H, Dv], each request attending to its own K/V only (from a
    compiled decode forward, through its custom operator)."""
    if torch.compiler.is_compiling():
        return compiled_ops.attention(query, key, value, module._fg_handle, module.layer_idx), None
    executor: Executor | None = getattr(module, "_fg_executor", None)
    ctx = executor.ctx if executor is not None else None
    if ctx is None or ctx.is_exact_baseline:
        q_len, kv_len = query.shape[2], key.shape[2]
        if attention_mask is None and 1 < q_len < kv_len:  # a chunk after cached positions: causal, offset
            offset = kv_len - q_len
            attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(offset)[None, None]
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if ctx.replay is not None:
        return ctx.replay.attend(module, query, key, value, **kwargs), None
    outputs, offset = [], 0
    layer_kv = executor.layer_kv
    for (keys, values), start, length in zip(layer_kv, ctx.batch.starts, ctx.batch.lengths, strict=True):
        mask = None
        if start and length > 1:  # a prefill chunk after cached positions: causal, offset by `start`
            mask = torch.ones(length, start + length, dtype=torch.bool, device=query.device).tril(start)[None, None]
        keys, values = keys[None], values[None]
        q = query[:, :, offset : offset + length]
        if hasattr(module, "expand_kv"):  # MLA caches latents; the module expands them after the cache read
            out = _attend_expanded(executor, module, q, keys, values, mask, **kwargs)
        else:
            out, _ = sdpa_attention_forward(module, q, keys, values, mask, **kwargs)
        outputs.append(out)
        offset += length
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)), None


def expanded_kv_bytes(module: torch.nn.Module, num_tokens: int, dtype: torch.dtype) -> int:
    """Bytes `module.expand_kv` allocates for one request's `num_tokens` cached latents: the `kv_b_proj`
    output (every head's non-positional key and value; the values stay views into it) and the keys with
    the shared positional part copied to every head."""
    proj = module.kv_b_proj
    num_heads = proj.out_features // (module.qk_nope_head_dim + module.v_head_dim)
    keys = num_heads * (module.qk_nope_head_dim + module.qk_rope_head_dim)
    return num_tokens * (proj.out_features + keys) * dtype.itemsize


def expand_bytes_per_token(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """The most bytes one cached position expands to in any layer of `model` (0: no MLA attention)."""
    return max((expanded_kv_bytes(m, 1, dtype) for m in model.modules() if hasattr(m, "expand_kv")), default=0)


def _attend_expanded(
    executor: Executor,
    module: torch.nn.Module,
    query: torch.Tensor,
    latents: torch.Tensor,
    rope_keys: torch.Tensor,
    mask: torch.Tensor | None,
    **kwargs: Any,
) -> torch.Tensor:
    """One request's attention over its expanded latents, the expansion held in the device pool."""
    num_bytes = expanded_kv_bytes(module, latents.shape[-2], latents.dtype)
    executor.ensure_room(num_bytes, f"layer {module.layer_idx}'s expanded K/V ({latents.shape[-2]} tokens)")
    with executor.kv_store.device_pool.held(Scratch.KV_EXPAND, num_bytes):
        keys, values = module.expand_kv(latents, rope_keys)
        out, _ = sdpa_attention_forward(module, query, keys, values, mask, **kwargs)
        del keys, values  # freed before the reservation is
    return out


def register_attention_function() -> None:
    """Register the engine's attention function (idempotent)."""
    AttentionInterface.register(ATTENTION_IMPLEMENTATION, paged_attention_forward)


def attach(model: torch.nn.Module, executor: Executor) -> None:
    """Route `model`'s attention through the engine: every attention module gets the executor."""
    register_attention_function()
    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "scaling"):
            module._fg_executor = executor
    model.config._attn_implementation = ATTENTION_IMPLEMENTATION

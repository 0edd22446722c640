"""Attention per request over the engine's paged KV, registered with transformers' attention interface.

The paged cache hands each layer's K/V to the executor request by request; this attention function then
runs transformers' own SDPA attention once per request of the packed forward, over that request's K/V
alone: no mask across requests (transformers builds none for an attention implementation it has no mask
function for), no copy of every request's K/V into one tensor, cost linear in the total KV. Each request
sees exactly what a single-sequence forward would: no mask when it starts at position 0 (causal) or
decodes one token, else a causal mask offset by its cached length. Outside an engine step (the exact
baseline, the shape probe) it is plain SDPA attention over the given K/V, causal and offset by the cached
length when a chunk follows cached positions. Attention modules that expand
cached latents after the cache read (MLA's ``expand_kv``) expand each request's latents here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

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
    """[1, H, T, D] packed queries -> [1, T, H, Dv], each request attending to its own K/V only."""
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
        if hasattr(module, "expand_kv"):  # MLA caches latents; the module expands them after the cache read
            keys, values = module.expand_kv(keys, values)
        out, _ = sdpa_attention_forward(module, query[:, :, offset : offset + length], keys, values, mask, **kwargs)
        outputs.append(out)
        offset += length
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)), None


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

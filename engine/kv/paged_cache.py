"""transformers Cache over the engine's paged KV store, so the model's own attention reads engine K/V."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

if TYPE_CHECKING:
    from fallbackgate.engine.experts.executor import Executor


class PagedLayer(CacheLayerMixin):
    """One decoder layer's view of the paged store for the current packed forward."""

    is_compileable = False
    is_sliding = False

    def __init__(self, executor: Executor, layer: int) -> None:
        super().__init__()
        self.executor = executor
        self.layer = layer
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to allocate: blocks are allocated by the engine before the forward."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this forward's K/V. In an engine step the paged attention function reads each request's
        K/V from the executor (`layer_kv`), so the forward gets back only its first token's (some models
        reshape with an inferred size, which zero tokens make ambiguous): what it does with them (MLA's
        `expand_kv` of the packed latents, every head's K/V of the whole chunk) stays one token's bytes
        outside the budget. The exact baseline and replay passes, whose attention uses what the forward
        passes, get this forward's own K/V. A compiled forward passes them through: its attention operator
        writes them (`compiled_ops.attention`)."""
        if torch.compiler.is_compiling():
            return key_states, value_states
        keys, values = self.executor.kv_update(self.layer, key_states, value_states)
        ctx = self.executor.ctx
        if ctx is not None and not ctx.is_exact_baseline and ctx.replay is None:
            return keys[..., :1, :], values[..., :1, :]
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        batch = self.executor.ctx.batch
        return sum(s + n for s, n in zip(batch.starts, batch.lengths, strict=True)), 0

    def get_seq_length(self) -> int:
        batch = self.executor.ctx.batch
        return max(batch.starts) if batch.starts else 0

    def get_max_length(self) -> int:
        return -1


class PagedCache(Cache):
    """A Cache whose layers write to and read from the engine's block tables."""

    def __init__(self, executor: Executor, num_layers: int) -> None:
        super().__init__(layers=[PagedLayer(executor, i) for i in range(num_layers)])

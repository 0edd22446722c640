"""The engine's three forward functions as torch custom operators, for a decode forward compiled whole.

``torch.compile`` traces the model's own modules (norms, projections, rotary embedding, router, LM head) into
one graph; where the model calls the engine — its K/V cache update, its attention function, its experts
function — the graph calls one of these operators instead, and each runs the engine's own Python function
unchanged: misses decided and served, the paged store read and written, every use recorded, as in an eager
forward. The operators are opaque to the compiler (fake implementations give only output shapes), so no
engine decision is traced or guarded on. Each finds the engine it serves through `TARGETS` by the handle the
engine registered (`register`); the hooks call them only while being compiled (`torch.compiler.is_compiling`).

They declare no mutated arguments, so their order in the graph is their data dependencies: a layer's attention
reads the K/V update's outputs, its experts the attention's result through the residual stream, the next layer's
update the experts' output — the order of an eager forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

KVUpdate = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Experts = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass(slots=True, frozen=True)
class OpTarget:
    """What one engine's operators call (each takes the decoder layer first)."""

    kv_update: KVUpdate  # (layer, K, V) -> the forward's K/V as the paged cache returns them
    attention: Attention  # (layer, Q, K, V) -> [1, T, H, Dv], each request over its own paged K/V
    experts: Experts  # (layer, hidden, top_k_index, top_k_weights) -> [T, hidden]


TARGETS: dict[int, OpTarget] = {}  # handle -> the engine's functions


def register(handle: int, target: OpTarget) -> None:
    """Make `target` the functions the operators call for `handle`."""
    TARGETS[handle] = target


def unregister(handle: int) -> None:
    """Forget `handle` (its engine is closed)."""
    TARGETS.pop(handle, None)


@torch.library.custom_op("fallbackgate::kv_update", mutates_args=())
def kv_update(key: torch.Tensor, value: torch.Tensor, handle: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the forward's K/V ``[1, heads, T, dim]`` into the paged store; returns what the paged cache gives
    an engine step back (the first token's K/V: attention reads each request's K/V from the executor)."""
    keys, values = TARGETS[handle].kv_update(layer, key, value)
    return keys[..., :1, :].clone(), values[..., :1, :].clone()


@kv_update.register_fake
def _(key: torch.Tensor, value: torch.Tensor, handle: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    return key[..., :1, :].clone(), value[..., :1, :].clone()


@torch.library.custom_op("fallbackgate::attention", mutates_args=())
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, handle: int, layer: int) -> torch.Tensor:
    """Paged attention of the packed queries ``[1, H, T, D]`` -> ``[1, T, H, Dv]`` (`key`, `value`: the K/V
    update's outputs, taken so the graph orders the update first)."""
    return TARGETS[handle].attention(layer, query, key, value).contiguous()


@attention.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, handle: int, layer: int) -> torch.Tensor:
    return query.new_empty((query.shape[0], query.shape[2], query.shape[1], value.shape[-1]))


@torch.library.custom_op("fallbackgate::experts", mutates_args=())
def experts(
    hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, handle: int, layer: int
) -> torch.Tensor:
    """The layer's routed experts of the packed tokens ``[T, hidden]``, as the engine serves them."""
    return TARGETS[handle].experts(layer, hidden, top_k_index, top_k_weights).contiguous()


@experts.register_fake
def _(
    hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, handle: int, layer: int
) -> torch.Tensor:
    return torch.empty_like(hidden)

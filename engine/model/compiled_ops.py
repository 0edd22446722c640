"""The engine's forward functions as torch custom operators, for a decode forward compiled whole.

``torch.compile`` traces the model's own modules (norms, projections, rotary embedding, router, LM head) into
one graph; where the model calls the engine, the graph calls an operator instead: `attention` for the K/V cache
update and the attention function (the cache passes K/V through in a compiled forward; the operator writes them,
then attends), `experts` for the experts function. Each runs the engine's own Python functions unchanged: misses
decided and served, the paged store read and written, every use recorded, as in an eager forward. The operators
are opaque to the compiler (fake implementations give only output shapes), so no engine decision is traced or
guarded on. Each finds the engine it serves through `TARGETS` by the handle the engine registered (`register`; a
handle is never reused, so a graph compiled for one engine, its handles baked in, never serves another); the
hooks call them only while being compiled (`torch.compiler.is_compiling`).

They declare no mutated arguments, so their order in the graph is their data dependencies: a layer's experts read
its attention's result through the residual stream, the next layer's attention the experts' output — the order
of an eager forward.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import torch
from torch import Tensor

KVUpdate = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Experts = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass(slots=True, frozen=True)
class OpTarget:
    """What one engine's operators call (each takes the decoder layer first)."""

    kv_update: KVUpdate  # (layer, K, V) -> the forward's K/V written, as the paged cache returns them
    attention: Attention  # (layer, Q, K, V) -> [1, T, H, Dv], each request over its own paged K/V
    experts: Experts  # (layer, hidden, top_k_index, top_k_weights) -> [T, hidden]


TARGETS: dict[int, OpTarget] = {}  # handle -> the engine's functions
ERRORS: dict[int, Exception] = {}  # handle -> what an operator raised during the current forward
_HANDLES = itertools.count(1)  # never reused in a process: a graph compiled for one engine names its handle


def register(target: OpTarget) -> int:
    """Make `target` the functions the operators call for a new handle; returns the handle."""
    handle = next(_HANDLES)
    TARGETS[handle] = target
    return handle


def unregister(handle: int) -> None:
    """Forget `handle` (its engine is closed)."""
    TARGETS.pop(handle, None)
    ERRORS.pop(handle, None)


def raise_pending(handle: int) -> None:
    """Re-raise, with its own type and message, what an operator of `handle` raised during the forward that
    just returned (a compiled graph's C++ wrapper would replace it with a bare RuntimeError)."""
    error = ERRORS.pop(handle, None)
    if error is not None:
        raise error


def _run(handle: int, call: Callable[[OpTarget], torch.Tensor], placeholder: Callable[[], torch.Tensor]) -> Tensor:
    """`call` on the handle's target; once one has raised in this forward the rest do no engine work and give
    `placeholder`'s output (the forward's result is discarded: `raise_pending` raises after it returns)."""
    if handle in ERRORS:
        return placeholder()
    try:
        return call(TARGETS[handle])
    except Exception as exc:  # noqa: BLE001 - kept whole and re-raised by raise_pending
        ERRORS[handle] = exc
        return placeholder()


@torch.library.custom_op("fallbackgate::attention", mutates_args=())
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, handle: int, layer: int) -> torch.Tensor:
    """The forward's K/V ``[1, heads, T, dim]`` written into the paged store, then paged attention of the packed
    queries ``[1, H, T, D]`` -> ``[1, T, H, Dv]`` (in the graph the cache update passes K/V through unchanged:
    one operator does both, in the eager order)."""

    def call(target: OpTarget) -> torch.Tensor:
        keys, values = target.kv_update(layer, key, value)
        return target.attention(layer, query, keys, values).contiguous()

    return _run(handle, call, lambda: _attention_shape(query, value).zero_())


def _attention_shape(query: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    return query.new_empty((query.shape[0], query.shape[2], query.shape[1], value.shape[-1]))


@attention.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, handle: int, layer: int) -> torch.Tensor:
    return _attention_shape(query, value)


@torch.library.custom_op("fallbackgate::experts", mutates_args=())
def experts(
    hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, handle: int, layer: int
) -> torch.Tensor:
    """The layer's routed experts of the packed tokens ``[T, hidden]``, as the engine serves them."""
    return _run(
        handle,
        lambda target: target.experts(layer, hidden, top_k_index, top_k_weights).contiguous(),
        lambda: torch.zeros_like(hidden),
    )


@experts.register_fake
def _(
    hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, handle: int, layer: int
) -> torch.Tensor:
    return torch.empty_like(hidden)

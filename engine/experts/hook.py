"""The engine's experts function, registered with transformers' experts interface.

Every routed-experts call of the model lands here; the dispatch (`dispatch.py`) asks the controller per
(expert, request) miss how the expert is served and performs exactly that computation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from fallbackgate.engine.controller import Decision
from fallbackgate.engine.errors import EngineError
from fallbackgate.engine.experts.store import ExpertKey, ExpertStore, Fetched
from fallbackgate.engine.model import compiled_ops
from fallbackgate.engine.tags import Tag, Tier

EXPERTS_IMPLEMENTATION = "fallbackgate"


class ExpertsRunner(Protocol):
    """What the engine attaches to every experts module (the executor): it computes the routed experts."""

    def run_experts(
        self,
        module: torch.nn.Module,
        layer: int,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor: ...


def fallbackgate_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Experts interface entry point: delegate to the executor attached to this module (from a compiled decode
    forward, through its custom operator)."""
    if torch.compiler.is_compiling():
        return compiled_ops.experts(hidden_states, top_k_index, top_k_weights, self._fg_handle, self._fg_layer)
    executor: ExpertsRunner | None = getattr(self, "_fg_executor", None)
    if executor is None:
        raise EngineError("experts module has no fallbackgate executor attached (model not built by the engine)")
    return executor.run_experts(self, self._fg_layer, hidden_states, top_k_index, top_k_weights)


def register_experts_function() -> None:
    """Register the engine's experts function (idempotent)."""
    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, fallbackgate_experts_forward)


@dataclasses.dataclass(slots=True)
class ExpertUse:
    """One request's rows (token * k + top-k position) routed to one expert in one layer, and its decision."""

    key: ExpertKey
    request_index: int
    rows: np.ndarray  # flat row indices, ascending
    decision: Decision


def served_tag(decision: Decision, is_observe: bool) -> Tag:
    """The tag actually served: in observe mode every approximate choice is served exactly (a forced one,
    a quarantined expert's, as forced)."""
    tag = decision.tag
    if is_observe and tag is not Tag.RESIDENT and not decision.is_forced:
        return Tag.EXACT_LOAD
    return tag


def renormalise_deferred(top_k_weights: torch.Tensor, deferred: torch.Tensor) -> torch.Tensor:
    """Zero deferred rows' weights (`deferred`: bool ``[T, k]``) and rescale each affected token's remaining
    weights to the old sum (the replay baseline renormalises with the same ops)."""
    kept = torch.where(deferred, torch.zeros_like(top_k_weights), top_k_weights)
    old_sum, new_sum = top_k_weights.sum(-1, keepdim=True), kept.sum(-1, keepdim=True)
    scale = torch.where(new_sum > 0, old_sum / new_sum.clamp_min(1e-30), torch.zeros_like(new_sum))
    return torch.where(deferred.any(-1, keepdim=True), kept * scale, top_k_weights)


def fetch_for_tag(store: ExpertStore, key: ExpertKey, tag: Tag, make_room: Callable[..., bool]) -> Fetched:
    """Get the weights a tag computes with, moving bytes as that tag does (`make_room`: the executor's, for a
    load that needs device room)."""
    if tag is Tag.RESIDENT:
        return Fetched(store.device_weights(key), None, 0)
    if tag is Tag.EXACT_LOAD:
        if not store.can_place(key):
            make_room(store.place_bytes, pinned_experts={key}, is_kv_evictable=False)
        if not store.can_place(key):
            raise EngineError(f"no device room for expert {key} even after eviction")
        return store.place(key)
    if tag is Tag.CPU_EXECUTE:  # computed where the host copy is: only a disk home moves weight bytes (to host)
        fetched = store.host_weights(key)
        return fetched if fetched.source_tier is Tier.DISK else Fetched(fetched.weights, None, 0, fetched.note)
    if tag is Tag.EXPERT_LOWBIT:
        return store.lowbit_weights(key)
    raise EngineError(f"{tag.value} is not an expert action")

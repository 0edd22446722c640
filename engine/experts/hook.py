"""The engine's experts function, registered with transformers' experts interface.

Every routed-experts call of the model lands here; the executor decides per (expert, request) how the
expert is served (through the controller) and performs exactly that computation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from fallbackgate.engine.controller import Controller, Decision
from fallbackgate.engine.errors import EngineError
from fallbackgate.engine.experts.faults import expert_miss, fault_decision
from fallbackgate.engine.experts.store import ExpertKey, ExpertStore, ExpertWeights, Fetched
from fallbackgate.engine.step_context import StepContext
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
    """Experts interface entry point: delegate to the executor attached to this module."""
    executor: ExpertsRunner | None = getattr(self, "_fg_executor", None)
    if executor is None:
        raise EngineError("experts module has no fallbackgate executor attached (model not built by the engine)")
    return executor.run_experts(self, self._fg_layer, hidden_states, top_k_index, top_k_weights)


def register_experts_function() -> None:
    """Register the engine's experts function (idempotent)."""
    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, fallbackgate_experts_forward)


def expert_mlp(module: torch.nn.Module, x: torch.Tensor, weights: ExpertWeights) -> torch.Tensor:
    """One expert's gated MLP, the same ops as transformers' eager experts loop."""
    proj = torch.nn.functional.linear(x, weights.gate_up)
    hidden = module._apply_gate(proj)
    return torch.nn.functional.linear(hidden, weights.down)


@dataclasses.dataclass(slots=True)
class ExpertUse:
    """One request's tokens routed to one expert in one layer."""

    key: ExpertKey
    request_index: int
    token_idx: torch.Tensor  # packed token indices
    top_k_pos: torch.Tensor  # which top-k slot of each token
    decision: Decision


def group_routing(
    owner: list[int], top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> dict[tuple[int, int], tuple[list[int], list[int], float]]:
    """(expert, request index) -> (token indices, top-k slots, max gate weight), in token order.

    Plain Python over the routing lists: a decode step routes a handful of tokens, where many tiny
    tensor ops would cost more than the experts themselves.
    """
    groups: dict[tuple[int, int], tuple[list[int], list[int], float]] = {}
    for token, (experts, weights) in enumerate(zip(top_k_index.tolist(), top_k_weights.tolist(), strict=True)):
        request_index = owner[token]
        for slot, (expert_id, weight) in enumerate(zip(experts, weights, strict=True)):
            tokens, slots, top = groups.get((expert_id, request_index), ([], [], 0.0))
            tokens.append(token)
            slots.append(slot)
            groups[(expert_id, request_index)] = (tokens, slots, max(top, weight))
    return groups


def plan_expert_uses(
    ctx: StepContext,
    store: ExpertStore,
    controller: Controller,
    layer: int,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> list[ExpertUse]:
    """Split routing into (expert, request) uses, experts ascending; ask the controller about each miss."""
    uses: list[ExpertUse] = []
    device = top_k_index.device
    for (expert_id, request_index), (tokens, slots, top) in sorted(
        group_routing(ctx.token_owner, top_k_index, top_k_weights).items()
    ):
        key = (layer, expert_id)
        if ctx.is_exact_baseline or store.is_on_device(key):
            decision = Decision(Tag.RESIDENT)
        else:
            miss = expert_miss(ctx, store, key, request_index, len(tokens), top)
            record = store.reader.quarantine.get(key)
            decision = fault_decision(controller, miss, record) if record else controller.expert_action(miss)
        token_idx = torch.tensor(tokens, device=device)
        uses.append(ExpertUse(key, request_index, token_idx, torch.tensor(slots, device=device), decision))
    return uses


def served_tag(use: ExpertUse, is_observe: bool) -> Tag:
    """The tag actually served: in observe mode every approximate choice is served exactly."""
    tag = use.decision.tag
    if is_observe and tag is not Tag.RESIDENT and not use.decision.is_forced:
        return Tag.EXACT_LOAD
    return tag


def renormalise_deferred(top_k_weights: torch.Tensor, uses: list[ExpertUse], is_observe: bool) -> torch.Tensor:
    """Zero deferred experts' weights and rescale each affected token's remaining weights to the old sum."""
    deferred = [u for u in uses if served_tag(u, is_observe) is Tag.EXPERT_DEFER]
    if not deferred:
        return top_k_weights
    weights = top_k_weights.clone()
    for use in deferred:
        weights[use.token_idx, use.top_k_pos] = 0.0
    rows = torch.unique(torch.cat([u.token_idx for u in deferred]))
    old_sum = top_k_weights[rows].sum(dim=-1, keepdim=True)
    new_sum = weights[rows].sum(dim=-1, keepdim=True)
    scale = torch.where(new_sum > 0, old_sum / new_sum.clamp_min(1e-30), torch.zeros_like(new_sum))
    weights[rows] = weights[rows] * scale
    return weights


def fetch_for_tag(store: ExpertStore, key: ExpertKey, tag: Tag, make_room: Callable[..., bool]) -> Fetched:
    """Get the weights a tag computes with, moving bytes as that tag does (`make_room`: the executor's, for a
    load that needs device room)."""
    if tag is Tag.RESIDENT:
        return Fetched(store.device_weights(key), None, 0)
    if tag is Tag.EXACT_LOAD:
        if not store.can_place(key):
            make_room(store.bytes_per_expert, pinned_experts={key}, is_kv_evictable=False)
        if not store.can_place(key):
            raise EngineError(f"no device room for expert {key} even after eviction")
        return store.place(key)
    if tag is Tag.CPU_EXECUTE:  # computed where the host copy is: only a disk home moves weight bytes (to host)
        fetched = store.host_weights(key)
        return fetched if fetched.source_tier is Tier.DISK else Fetched(fetched.weights, None, 0, fetched.note)
    if tag is Tag.EXPERT_LOWBIT:
        return store.lowbit_weights(key)
    raise EngineError(f"{tag.value} is not an expert action")

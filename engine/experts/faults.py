"""What a quarantined expert does to the requests routed to it (see :mod:`.quarantine`).

Each request whose tokens need a quarantined expert is asked about through the controller
(:meth:`Controller.fault_action`): ``expert_defer`` when its class allows it and its budget has room (the event's
note names the quarantine), otherwise the request fails alone (``EventLog.fail``): its tokens skip the expert
in this forward, its output is discarded and it ends with the quarantine as its error. Other requests of the
same forward, the same layer included, are computed exactly as they would be without it: experts act per token.

A fault found in the middle of a layer (the read of an expert the controller had chosen to load) is settled the
same way; tokens that then defer it have the expert's gate weight taken out of their already accumulated output
by one rescale at the end of the layer (`rescale_late_defers`), equal to renormalising before computing.
"""

from __future__ import annotations

import torch

from fallbackgate.engine.controller import Controller, Decision, ExpertMiss
from fallbackgate.engine.experts.quarantine import QuarantineRecord
from fallbackgate.engine.experts.store import ExpertKey, ExpertStore
from fallbackgate.engine.step_context import StepContext
from fallbackgate.engine.tags import Tag


def expert_miss(
    ctx: StepContext,
    store: ExpertStore,
    key: ExpertKey,
    request_index: int,
    num_tokens: int,
    top: float,
    layer_expert_ids: tuple[int, ...] = (),
) -> ExpertMiss:
    """The miss the controller is asked about: request `request_index`'s `num_tokens` tokens need `key`
    (`layer_expert_ids`: every expert its layer routes in this forward)."""
    return ExpertMiss(
        ctx.step_id,
        ctx.batch.request_ids[request_index],
        ctx.batch.request_classes[request_index],
        key[0],
        key[1],
        num_tokens,
        top,
        store.home(key),
        store.bytes_per_expert,
        store.has_lowbit(key),
        store.device_pool.can_reserve(store.bytes_per_expert),
        str(store.reader.compute_dtype).removeprefix("torch."),
        not store.is_ram_tiered,
        store.lowbit_disk_bytes(key),
        layer_expert_ids,
    )


def fault_decision(controller: Controller, miss: ExpertMiss, record: QuarantineRecord) -> Decision:
    """A forced ``expert_defer`` (served even in observe mode): allowed by the controller, or carrying the
    request's failure when it is not."""
    fault = f"quarantined: {record.summary}"
    decided = controller.fault_action(miss, fault)
    if decided is not None and decided.tag is Tag.EXPERT_DEFER:
        reason = fault if not decided.reason else f"{fault}; {decided.reason}"
        return Decision(Tag.EXPERT_DEFER, decided.predicted_cost, reason, is_forced=True)
    return Decision(Tag.EXPERT_DEFER, reason=fault, is_forced=True, failure=fault)


def rescale_late_defers(
    out: torch.Tensor, weights: torch.Tensor, late: list[tuple[torch.Tensor, torch.Tensor]]
) -> None:
    """Take late-deferred experts out of `out` in place: `weights` [T, k] are the gate weights the layer
    computed with, `late` the (token indices, top-k slots) deferred after their tokens' other experts began
    accumulating. Each affected row is scaled by its weight sum over the sum without the deferred slots."""
    if not late:
        return
    kept = weights.clone()
    for token_idx, top_k_pos in late:
        kept[token_idx, top_k_pos] = 0.0
    rows = torch.unique(torch.cat([token_idx for token_idx, _ in late]))
    old_sum = weights[rows].sum(dim=-1, keepdim=True)
    new_sum = kept[rows].sum(dim=-1, keepdim=True)
    scale = torch.where(new_sum > 0, old_sum / new_sum.clamp_min(1e-30), torch.zeros_like(new_sum))
    out[rows] = (out[rows] * scale).to(out.dtype)

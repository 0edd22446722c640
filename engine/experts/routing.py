"""A layer's routing grouped once, with tensor ops and one host copy.

Routing arrives as ``top_k_index [T, k]``; each (token, top-k) pair is a *row*. The rows are translated to
slots of the expert pool on the device (no sync); one packed copy of (expert, slot, weight) per row comes
to the host, where numpy groups the rows into (expert, request) uses (sorted by expert, then request, as a
moe_align-style sort by expert does) and picks out the uses whose expert is not on device — the misses,
decided per (expert, request) because quality classes are per request.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch


@dataclasses.dataclass(slots=True)
class MissUse:
    """One request's rows routed to one expert that is not on device."""

    expert_id: int
    request_index: int
    rows: np.ndarray  # flat row indices (token * k + top-k position), ascending
    top_weight: float  # largest gate weight among them


@dataclasses.dataclass(slots=True)
class LayerRouting:
    """One layer's routing on the host: rows, the resident uses counted per request, the misses."""

    experts: np.ndarray  # [T * k] expert id per row
    slots: np.ndarray  # [T * k] pool slot per row (-1: not on device)
    used_experts: np.ndarray  # every expert routed to, ascending
    resident_uses: np.ndarray  # [R] (expert, request) uses per request whose expert is on device
    misses: list[MissUse]  # experts ascending, then requests ascending


def row_owner(token_owner: list[int], top_k: int) -> np.ndarray:
    """Request index of each (token, top-k) row."""
    return np.repeat(np.asarray(token_owner, dtype=np.int64), top_k)


def group_layer(
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    table: torch.Tensor,
    owner: np.ndarray,
    num_requests: int,
    row_slots: torch.Tensor | None = None,
) -> LayerRouting:
    """Group one layer's rows; `table` maps expert id -> slot (-1: off device), `owner` each row's request.

    `row_slots` is ``table[top_k_index.reshape(-1)]`` when the caller already gathered it on the device.
    """
    flat = top_k_index.reshape(-1)
    if row_slots is None:
        row_slots = table[flat]
    packed = torch.stack([flat.double(), row_slots.double(), top_k_weights.reshape(-1).double()])
    host = packed.cpu().numpy()  # the layer's one host sync
    experts, slots, weights = host[0].astype(np.int64), host[1].astype(np.int64), host[2]
    pairs = experts * num_requests + owner
    is_miss = slots < 0
    resident_pairs = np.unique(pairs[~is_miss])
    resident_uses = np.bincount(resident_pairs % num_requests, minlength=num_requests)
    misses: list[MissUse] = []
    if is_miss.any():
        miss_rows = np.flatnonzero(is_miss)
        order = miss_rows[np.argsort(pairs[miss_rows], kind="stable")]
        sorted_pairs = pairs[order]
        starts = np.flatnonzero(np.r_[True, sorted_pairs[1:] != sorted_pairs[:-1]])
        tops = np.maximum.reduceat(weights[order], starts)
        for group, (start, end) in enumerate(zip(starts, np.r_[starts[1:], len(order)], strict=True)):
            pair = int(sorted_pairs[start])
            rows = np.sort(order[start:end])
            misses.append(MissUse(pair // num_requests, pair % num_requests, rows, float(tops[group])))
    return LayerRouting(experts, slots, np.unique(experts), resident_uses, misses)

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

MAX_SMALL_ROWS = 64  # rows of a layer grouped with Python sets when all are resident


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
    weights: np.ndarray | None = None
    if flat.device.type == "cpu":  # the host arrays view the tensors: nothing to copy
        experts, slots = flat.numpy().astype(np.int64, copy=False), row_slots.numpy().astype(np.int64, copy=False)
    else:
        packed = torch.stack([flat.double(), row_slots.double(), top_k_weights.reshape(-1).double()])
        host = packed.cpu().numpy()  # the layer's one host sync
        experts, slots, weights = host[0].astype(np.int64), host[1].astype(np.int64), host[2]
    if len(experts) <= MAX_SMALL_ROWS and not (slots < 0).any():  # a decode's few rows, all resident
        return _resident_small(experts, slots, owner, num_requests)
    pairs = experts * num_requests + owner
    is_miss = slots < 0
    resident_pairs = np.unique(pairs[~is_miss])
    resident_uses = np.bincount(resident_pairs % num_requests, minlength=num_requests)
    misses: list[MissUse] = []
    if is_miss.any():
        if weights is None:
            weights = top_k_weights.reshape(-1).double().numpy()
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


def _resident_small(experts: np.ndarray, slots: np.ndarray, owner: np.ndarray, num_requests: int) -> LayerRouting:
    """:func:`group_layer` of a few rows whose experts are all on device, with Python sets (numpy's per-call
    cost dominates at this size)."""
    used = sorted(set(experts.tolist()))
    resident_uses = np.zeros(num_requests, dtype=np.int64)
    for _, request_index in set(zip(experts.tolist(), owner.tolist(), strict=True)):
        resident_uses[request_index] += 1
    return LayerRouting(experts, slots, np.asarray(used, dtype=np.int64), resident_uses, [])


# --- routing digests: what the audit's replay checks its own routing against ----------------------------
DIGEST_MASK = (1 << 64) - 1  # digests are sums modulo 2**64
_POSITION_STRIDE = np.uint64(1 << 24)  # expert ids stay below this
_GOLDEN, _M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S27, _S30, _S31 = np.uint64(27), np.uint64(30), np.uint64(31)


def digest_terms(positions: np.ndarray, experts: np.ndarray) -> np.ndarray:
    """uint64 term of each (token, expert) routed: splitmix64 of (absolute position, expert id), so a
    request's routing digest -- the sum of its terms modulo 2**64 -- does not depend on the order of a
    token's top-k, and one expert swapped at one token changes it by a known amount. `positions` [T],
    `experts` [T, k] (or broadcastable to it)."""
    z = positions.astype(np.uint64)[:, None] * _POSITION_STRIDE + experts.astype(np.uint64)  # arrays wrap silently
    z += _GOLDEN
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


_STRIDE, _GOLDEN_INT, _M1_INT, _M2_INT = int(_POSITION_STRIDE), int(_GOLDEN), int(_M1), int(_M2)


def _splitmix(z: int) -> int:
    """:func:`digest_terms` of one (position, expert) as Python ints (``z`` = position * stride + expert)."""
    z = (z + _GOLDEN_INT) & DIGEST_MASK
    z = ((z ^ (z >> 30)) * _M1_INT) & DIGEST_MASK
    z = ((z ^ (z >> 27)) * _M2_INT) & DIGEST_MASK
    return z ^ (z >> 31)


def digest_sum(terms: np.ndarray) -> int:
    """The digest of `terms`: their sum modulo 2**64."""
    return int(terms.sum(dtype=np.uint64)) & DIGEST_MASK


def request_digests(experts: np.ndarray, top_k: int, starts: list[int], lengths: list[int]) -> list[int]:
    """Routing digest of each request of a packed forward (its tokens contiguous, `lengths` of them from
    position `starts`): one vectorized pass over the layer's host copy of the routing (`experts`, [T * k])."""
    num_tokens = int(sum(lengths))
    if num_tokens == len(lengths) and len(experts) <= MAX_SMALL_ROWS:  # a small decode forward: Python ints
        flat = experts.tolist()
        return [
            sum(_splitmix(start * _STRIDE + e) for e in flat[i * top_k : (i + 1) * top_k]) & DIGEST_MASK
            for i, start in enumerate(starts)
        ]
    if num_tokens == len(lengths):  # a decode forward: one token per request
        terms = digest_terms(np.asarray(starts), experts.reshape(num_tokens, top_k))
        return terms.sum(axis=1, dtype=np.uint64).tolist()
    if not all(lengths):
        raise ValueError("every request of a forward has at least one token")
    offsets = np.cumsum([0, *lengths[:-1]])
    positions = np.arange(num_tokens) + np.repeat(np.asarray(starts) - offsets, lengths)
    terms = digest_terms(positions, experts.reshape(num_tokens, top_k))
    return np.add.reduceat(terms.sum(axis=1, dtype=np.uint64), offsets).tolist()

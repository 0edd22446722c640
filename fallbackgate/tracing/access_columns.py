"""Expanding engine captures into ``expert_access`` and ``kv_access`` columns with numpy: the routing calls and
KV reads of many steps at once, one row per (token, router rank) and per (request, layer, block read); a
use's or block's bytes and wait on its first row, resident defaults for everything the capture does not list."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch

from fallbackgate.engine.messages import StepCapture
from fallbackgate.engine.tags import Tag, Tier
from fallbackgate.tracing.writer import Indexed

TIER_CODE = {t: i for i, t in enumerate(Tier)}  # the schema's tier vocabulary is Tier's values in order
TAG_CODE = {t: i for i, t in enumerate(Tag)}  # likewise for tags


def expert_columns(step: int | np.ndarray, cap: StepCapture, names: list[str], index: dict[str, int]) -> dict[str, Any]:
    """``expert_access`` columns: one row per (token, router rank) of every routing call of ``cap`` (``step``:
    their step, or each call's); request ids index ``names``."""
    calls = cap.routing
    k = int(calls[0].top_k_index.shape[-1])
    owners: dict[int, np.ndarray] = {}  # per forward (its token_owner tensor): each token's step request index
    for c in calls:
        if id(c.token_owner) not in owners:
            mapping = np.array([index[r] for r in c.request_ids], dtype=np.int64)
            owners[id(c.token_owner)] = mapping[c.token_owner.cpu().numpy()]
    ids = torch.cat([c.top_k_index for c in calls]).reshape(-1).cpu().numpy().astype(np.int64)
    weights = torch.cat([c.top_k_weights for c in calls]).reshape(-1).float().cpu().numpy()
    request = np.concatenate([owners[id(c.token_owner)] for c in calls]).repeat(k)
    per_call = np.array([int(c.token_owner.numel()) * k for c in calls], dtype=np.int64)
    call = np.repeat(np.arange(len(calls)), per_call)
    num_experts, num_requests = int(ids.max(initial=0)) + 1, len(names)
    if cap.expert_served:
        num_experts = max(num_experts, max(e for _, e, *_ in cap.expert_served) + 1)
    key = (call * num_experts + ids) * num_requests + request
    served = _served_columns(key, cap.expert_served, num_experts, num_requests, index)
    predicted = np.zeros(len(key), dtype=bool)
    for i, c in enumerate(calls):
        if c.named_ids:
            rows_of_call = call == i
            predicted[rows_of_call] = np.isin(ids[rows_of_call], np.array(c.named_ids))
    return {
        "step": np.repeat(np.broadcast_to(np.asarray(step, dtype=np.int64), (len(calls),)), per_call),
        "request": Indexed(names, request),
        "layer": np.repeat(np.array([c.layer for c in calls], dtype=np.int64), per_call),
        "expert": ids,
        "router_rank": np.tile(np.arange(k), len(key) // k),
        "router_weight": weights,
        **served,
        "is_predicted": predicted,
    }


def _served_columns(
    key: np.ndarray, served: list[tuple], num_experts: int, num_requests: int, index: dict[str, int]
) -> dict[str, np.ndarray]:
    """Per row (``key``: call, expert, request), the tier before, tag, bytes and wait of the uses ``served``
    lists (resident from device, 0 bytes, 0 ns for the rest); a use's bytes and wait on its first row."""
    tier = np.full(len(key), TIER_CODE[Tier.DEVICE], dtype=np.int32)
    tag = np.full(len(key), TAG_CODE[Tag.RESIDENT], dtype=np.int32)
    moved, waited = np.zeros(len(key), dtype=np.int64), np.zeros(len(key), dtype=np.int64)
    if served:
        m_key = np.array([(c * num_experts + e) * num_requests + index[r] for c, e, r, *_ in served], dtype=np.int64)
        order = np.argsort(m_key, kind="stable")
        sorted_keys = m_key[order]
        pos = np.clip(np.searchsorted(sorted_keys, key), 0, len(sorted_keys) - 1)
        hit = sorted_keys[pos] == key
        rows = order[pos[hit]]
        tier[hit] = np.array([TIER_CODE[s[3]] for s in served], dtype=np.int32)[rows]
        tag[hit] = np.array([TAG_CODE[s[4]] for s in served], dtype=np.int32)[rows]
        first = np.zeros(len(key), dtype=bool)
        first[np.unique(key, return_index=True)[1]] = True
        carry = hit & first
        moved[carry] = np.array([s[5] for s in served], dtype=np.int64)[order[pos[carry]]]
        waited[carry] = np.array([s[6] for s in served], dtype=np.int64)[order[pos[carry]]]
    return {"tier_before": tier, "tag": tag, "bytes": moved, "ns": waited}


class KVPending:
    """Steps' KV reads kept as a few numbers per request until they are expanded into rows together."""

    def __init__(self) -> None:
        self.steps: list[int] = []  # per request read: its step
        self.requests: list[int] = []  # its request (a code into the caller's names)
        self.blocks: list[int] = []  # blocks 0..n-1 of its table read in every layer
        self.hashes: list[list[int]] = []  # content hashes of its full blocks (the first ones; none: not hashed)
        self.served: list[tuple[int, int, int, int, int, int, int]] = []  # (read index, layer, block, tier code,
        # tag code, bytes, ns) per off-device block made usable

    def __len__(self) -> int:
        return len(self.blocks)

    def add(self, step: int, cap: StepCapture, index: dict[str, int]) -> int:
        """Keep one step's reads; returns the rows they will make (per layer count the caller multiplies)."""
        offset = len(self.blocks)
        position = {rid: offset + i for i, (rid, _) in enumerate(cap.kv_reads)}
        for (rid, layer, block), (before, served, num_bytes, ns) in cap.kv_served.items():
            i = position.get(rid)
            if i is None or block >= cap.kv_reads[i - offset][1]:
                raise ValueError(f"step {step}: KV block {(rid, layer, block)} was served but is not among the "
                                 "step's reads")  # fmt: skip
            self.served.append((i, layer, block, TIER_CODE[before], TAG_CODE[served], num_bytes, ns))
        self.steps += [step] * len(cap.kv_reads)
        self.requests += [index[rid] for rid, _ in cap.kv_reads]
        self.blocks += [n for _, n in cap.kv_reads]
        self.hashes += [cap.kv_hashes.get(rid, []) for rid, _ in cap.kv_reads]
        return sum(n for _, n in cap.kv_reads)

    def columns(self, num_layers: int) -> dict[str, Any]:
        """``kv_access`` columns of every kept read (``request`` as the kept codes)."""
        blocks = np.array(self.blocks, dtype=np.int64)
        segment = np.repeat(blocks, num_layers)  # rows per (read, layer)
        starts = np.concatenate([[0], np.cumsum(segment)[:-1]]).astype(np.int64)
        total = int(segment.sum())
        tier = np.full(total, TIER_CODE[Tier.DEVICE], dtype=np.int32)
        tag = np.full(total, TAG_CODE[Tag.RESIDENT], dtype=np.int32)
        moved, waited = np.zeros(total, dtype=np.int64), np.zeros(total, dtype=np.int64)
        if self.served:
            served = np.array(self.served, dtype=np.int64)
            rows = starts[served[:, 0] * num_layers + served[:, 1]] + served[:, 2]
            tier[rows], tag[rows], moved[rows], waited[rows] = served[:, 3], served[:, 4], served[:, 5], served[:, 6]
        return {
            "step": np.repeat(np.array(self.steps, dtype=np.int64), blocks * num_layers),
            "request": np.repeat(np.array(self.requests, dtype=np.int64), blocks * num_layers),
            "layer": np.repeat(np.tile(np.arange(num_layers), len(blocks)), segment),
            "block": np.arange(total, dtype=np.int64) - np.repeat(starts, segment),
            "content_hash": self._hash_column(num_layers),
            "tier_before": tier, "tag": tag, "bytes": moved, "ns": waited,
        }  # fmt: skip

    def _hash_column(self, num_layers: int) -> np.ma.MaskedArray | None:
        """Each row's block content hash, null for blocks not hashed (a partial tail); None: none hashed."""
        if not any(self.hashes):
            return None
        blocks = np.array(self.blocks, dtype=np.int64)
        num_known = np.minimum([len(h) for h in self.hashes], blocks)  # hashed blocks per read (the first ones)
        read_starts = np.concatenate([[0], np.cumsum(blocks)[:-1]]).astype(np.int64)  # per read, into `known`
        known = np.zeros(int(blocks.sum()), dtype=np.uint64)  # per read, its blocks' hashes (0 where none)
        is_known = np.zeros(len(known), dtype=bool)
        flat = np.fromiter(itertools.chain.from_iterable(h[:n] for h, n in zip(self.hashes, num_known, strict=True)),
                           dtype=np.uint64, count=int(num_known.sum()))  # fmt: skip
        known_starts = np.concatenate([[0], np.cumsum(num_known)[:-1]]).astype(np.int64)
        at = np.repeat(read_starts, num_known) + np.arange(len(flat)) - np.repeat(known_starts, num_known)
        known[at], is_known[at] = flat, True
        rows_per_read = blocks * num_layers  # rows (layer-major, then block) of each read
        row_read = np.repeat(np.arange(len(blocks)), rows_per_read)
        row_starts = np.concatenate([[0], np.cumsum(rows_per_read)[:-1]]).astype(np.int64)
        row_block = (np.arange(int(rows_per_read.sum())) - np.repeat(row_starts, rows_per_read)) % np.repeat(
            np.maximum(blocks, 1), rows_per_read
        )
        index = read_starts[row_read] + row_block
        return np.ma.MaskedArray(known[index], mask=~is_known[index])


def kv_columns(step: int, cap: StepCapture, names: list[str], index: dict[str, int], num_layers: int) -> dict:
    """``kv_access`` columns of one step: every block of every request's table it read, in every layer."""
    pending = KVPending()
    pending.add(step, cap, index)
    columns = pending.columns(num_layers)
    columns["request"] = Indexed(names, columns["request"])
    return columns

"""The adapter the engine side calls once per step to record a trace (``run --trace DIR``): tensors in, rows
out, never a Python loop over accesses.

Per step the caller hands the routing tensors and what happened to each object, and :class:`StepTracer`
expands them into ``expert_access`` and ``kv_access`` rows:

- experts: ``topk_ids`` / ``topk_weights`` [layers, tokens, k] and ``token_request`` [tokens] (index into
  the step's request ids); per object [layers, num_experts]: ``tier_before``, ``tag`` (codes in
  :data:`~fallbackgate.tracing.schema.VOCABULARIES` order, i.e. the engine's ``Tier`` and ``Tag`` enums),
  ``bytes`` and ``wait_ns``. An object's bytes and wait go on its first row in the step; the other rows
  that use it carry its tier and tag with 0 bytes and 0 ns (so sums over rows are the step's totals).
- KV: per request, ``block_ids`` [blocks] (indices into its block table) and per (layer, block)
  ``tier_before``, ``tag``, ``bytes``, ``wait_ns`` [layers, blocks]; ``content_hash`` [blocks] optional.

I/O, arbitration and request rows go straight to :meth:`TraceWriter.append` (they are batches already).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from fallbackgate.tracing.schema import TraceTable
from fallbackgate.tracing.writer import Indexed, TraceFormatError, TraceWriter, to_numpy


@dataclasses.dataclass(slots=True)
class ExpertStep:
    """One step's routing and per-expert outcomes (arrays or tensors)."""

    token_request: Any  # [tokens] int: index into the step's request ids
    topk_ids: Any  # [layers, tokens, k] int: chosen experts, rank order
    topk_weights: Any  # [layers, tokens, k] float: their router weights
    tier_before: Any  # [layers, num_experts] int: Tier code before the step
    tag: Any  # [layers, num_experts] int: Tag code it was served with
    bytes: Any  # [layers, num_experts] int: bytes moved for it this step
    wait_ns: Any  # [layers, num_experts] int: time the step waited for it
    is_predicted: Any = None  # [layers, num_experts] bool: named by the next-layer predictor (None: no predictor)


@dataclasses.dataclass(slots=True)
class KVStep:
    """One request's KV block reads in one step."""

    request_index: int  # index into the step's request ids
    block_ids: Any  # [blocks] int: block-table indices read
    tier_before: Any  # [layers, blocks] int: Tier code before the read
    tag: Any  # [layers, blocks] int: Tag code it was served with
    bytes: Any  # [layers, blocks] int
    wait_ns: Any  # [layers, blocks] int
    content_hash: Any = None  # [blocks] uint64 (None: not hashed)


@dataclasses.dataclass(slots=True)
class KVReads:
    """A whole step's KV reads as flat arrays (one entry per request × layer × block read): the cheapest form."""

    request_index: Any  # [n] int: index into the step's request ids
    layer: Any  # [n] int
    block: Any  # [n] int: block-table index
    tier_before: Any  # [n] int: Tier code before the read
    tag: Any  # [n] int: Tag code it was served with
    bytes: Any  # [n] int
    wait_ns: Any  # [n] int
    content_hash: Any = None  # [n] uint64 (None: not hashed)


def _np(x: Any) -> np.ndarray:
    return np.asarray(to_numpy(x))


class StepTracer:
    """Expands per-step tensors into trace rows on a :class:`TraceWriter`."""

    def __init__(self, writer: TraceWriter):
        self.writer = writer

    def record_step(
        self, step: int, phase: int | str, start_ns: int, end_ns: int, request_ids: Sequence[str], num_tokens: int,
        experts: ExpertStep | None = None, kv: Sequence[KVStep] | KVReads = (),
    ) -> None:  # fmt: skip
        """Write one step's row and its expert and KV accesses."""
        self.writer.append(TraceTable.STEPS, step=[step], phase=[phase], start_ns=[start_ns], end_ns=[end_ns],
                           batch=[len(request_ids)], tokens=[num_tokens])  # fmt: skip
        names = list(request_ids)
        if experts is not None:
            self._experts(step, names, experts)
        if isinstance(kv, KVReads):
            self._flat_kv(step, names, kv)
        elif kv:
            self._kv(step, names, kv)

    def _experts(self, step: int, names: list[str], e: ExpertStep) -> None:
        ids = _np(e.topk_ids).astype(np.int64)
        if ids.ndim != 3:
            raise TraceFormatError(f"expert_access: topk_ids must be [layers, tokens, k], got shape {ids.shape}")
        num_layers, num_tokens, k = ids.shape
        token_request = _np(e.token_request).astype(np.int64)
        if token_request.shape != (num_tokens,) or (num_tokens and token_request.max() >= len(names)):
            raise TraceFormatError(f"expert_access: token_request must be [{num_tokens}] indices into the requests")
        layer = np.broadcast_to(np.arange(num_layers)[:, None, None], ids.shape).reshape(-1)
        flat = ids.reshape(-1)
        per_object = {n: _np(getattr(e, n)) for n in ("tier_before", "tag", "bytes", "wait_ns")}
        num_experts = per_object["tier_before"].shape[-1]
        key = layer * num_experts + flat
        first = np.zeros(len(key), dtype=bool)
        first[np.unique(key, return_index=True)[1]] = True  # an object's bytes and wait go on its first row
        gather = {n: v.reshape(-1)[key] for n, v in per_object.items()}
        predicted = np.zeros(len(key), bool) if e.is_predicted is None else _np(e.is_predicted).reshape(-1)[key]
        self.writer.append(
            TraceTable.EXPERT_ACCESS, step=np.full(len(key), step),
            request=Indexed(names, np.broadcast_to(token_request[None, :, None], ids.shape).reshape(-1)), layer=layer,
            expert=flat, router_rank=np.broadcast_to(np.arange(k), ids.shape).reshape(-1),
            router_weight=_np(e.topk_weights).reshape(-1), tier_before=gather["tier_before"], tag=gather["tag"],
            bytes=np.where(first, gather["bytes"], 0), ns=np.where(first, gather["wait_ns"], 0),
            is_predicted=predicted,
        )  # fmt: skip

    def _kv(self, step: int, names: list[str], reads: Sequence[KVStep]) -> None:
        """All requests' KV reads of the step as one batch."""
        parts: dict[str, list[np.ndarray]] = {
            n: [] for n in ("request", "layer", "block", "hash", "tier", "tag", "bytes", "ns")
        }
        has_hash = all(read.content_hash is not None for read in reads)
        for read in reads:
            tier = _np(read.tier_before)
            if tier.ndim != 2:
                raise TraceFormatError(f"kv_access: tier_before must be [layers, blocks], got shape {tier.shape}")
            num_layers, num_blocks = tier.shape
            blocks = _np(read.block_ids).astype(np.int64)
            if blocks.shape != (num_blocks,):
                raise TraceFormatError(f"kv_access: block_ids must be [{num_blocks}], got shape {blocks.shape}")
            parts["request"].append(np.full(tier.size, read.request_index))
            parts["layer"].append(np.repeat(np.arange(num_layers), num_blocks))
            parts["block"].append(np.tile(blocks, num_layers))
            if has_hash:
                parts["hash"].append(np.tile(_np(read.content_hash).astype(np.uint64), num_layers))
            parts["tier"].append(tier.reshape(-1))
            for name, values in (("tag", read.tag), ("bytes", read.bytes), ("ns", read.wait_ns)):
                parts[name].append(_np(values).reshape(-1))
        cat = {n: np.concatenate(v) if v else None for n, v in parts.items()}
        self.writer.append(
            TraceTable.KV_ACCESS, step=np.full(len(cat["layer"]), step), request=Indexed(names, cat["request"]),
            layer=cat["layer"], block=cat["block"], content_hash=cat["hash"], tier_before=cat["tier"], tag=cat["tag"],
            bytes=cat["bytes"], ns=cat["ns"],
        )  # fmt: skip

    def _flat_kv(self, step: int, names: list[str], kv: KVReads) -> None:
        layer = _np(kv.layer)
        self.writer.append(
            TraceTable.KV_ACCESS, step=np.full(len(layer), step), request=Indexed(names, _np(kv.request_index)),
            layer=layer,
            block=kv.block, content_hash=kv.content_hash, tier_before=kv.tier_before, tag=kv.tag, bytes=kv.bytes,
            ns=kv.wait_ns,
        )  # fmt: skip

"""What the replay baseline repeats for one request, read back from the ledger.

The trace is built from ledger rows only (``step_requests`` and the events that name their objects), never
from engine state: a writer that dropped a step or an approximate event makes the replay diverge from what
was served, which is how the replay also checks the ledger.
"""

from __future__ import annotations

import dataclasses

from fallbackgate.engine.tags import ObjectKind, Tag
from fallbackgate.ledger import audit_queries, kv_copy_queries
from fallbackgate.ledger.db import Ledger

ADOPTED_PREFIX_STEP = -1  # step id of the segment that recomputes adopted prefix blocks: no step acted on it


class TraceError(ValueError):
    """The ledger's rows for a request cannot describe what was served (missing or contradictory steps)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Segment:
    """One step's own forward for the request."""

    step_id: int  # engine step
    start: int  # first position it computed
    num_tokens: int  # positions it computed
    is_sampled: bool  # its last position produced an output token


@dataclasses.dataclass(slots=True)
class ExpertActions:
    """Approximate expert actions of one forward (a step's own, or its KV rebuild pass), per layer."""

    deferred: dict[int, set[int]] = dataclasses.field(default_factory=dict)  # layer -> deferred expert ids
    lowbit: dict[int, dict[int, int]] = dataclasses.field(default_factory=dict)  # layer -> expert id -> bits


@dataclasses.dataclass(slots=True)
class KVActions:
    """KV blocks a step read in another version than the one its positions wrote, per layer."""

    dequantized: dict[int, dict[int, int]] = dataclasses.field(default_factory=dict)  # layer -> block -> bits
    rebuilt: dict[int, set[int]] = dataclasses.field(default_factory=dict)  # layer -> blocks rebuilt first


@dataclasses.dataclass(slots=True)
class ReplayTrace:
    """Everything needed to recompute one request as it was served."""

    request_id: str
    token_ids: list[int]  # prompt then output tokens
    num_prompt_tokens: int
    segments: list[Segment]  # in step order
    experts: dict[tuple[int, bool], ExpertActions]  # (step, is rebuild pass) -> actions
    kv: dict[int, KVActions]  # step -> KV versions read
    # (layer, block, bits) -> (step, xxh3-64 of the codes) of each quantized copy written, in write order
    code_checksums: dict[tuple[int, int, int], list[tuple[int, int]]] = dataclasses.field(default_factory=dict)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def is_rebuilt(self, step_id: int) -> bool:
        """True when the step rebuilt KV blocks before its own forward."""
        kv = self.kv.get(step_id)
        return kv is not None and bool(kv.rebuilt)

    def served_checksum(self, step_id: int, layer: int, block: int, bits: int) -> int | None:
        """Codes' checksum of the latest `bits` copy of the block written by step `step_id` (what that step
        read dequantized); None when the ledger recorded none (written before checksums were recorded)."""
        written = [c for s, c in self.code_checksums.get((layer, block, bits), ()) if s <= step_id]
        return written[-1] if written else None

    def kv_reads(self, step_id: int) -> tuple[tuple[int, tuple[tuple[int, int], ...]], ...]:
        """What the step's queries read dequantized, as a comparable value: consecutive steps with equal
        reads can be replayed in one forward."""
        kv = self.kv.get(step_id)
        if kv is None:
            return ()
        return tuple(sorted((layer, tuple(sorted(blocks.items()))) for layer, blocks in kv.dequantized.items()))


def _ids(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def load_trace(ledger: Ledger, run_id: int, request_id: str) -> ReplayTrace:
    """The request's replay trace; TraceError when its tokens or step rows are missing."""
    tokens = audit_queries.request_tokens(ledger, run_id, request_id)
    if tokens is None:
        raise TraceError(f"request {request_id}: no token ids recorded")
    rows = audit_queries.step_requests(ledger, run_id, request_id)
    if not rows:
        raise TraceError(f"request {request_id}: no step rows recorded")
    segments = [Segment(r["step_id"], r["start_position"], r["num_tokens"], bool(r["is_sampled"])) for r in rows]
    num_reused = audit_queries.request_reused_tokens(ledger, run_id, request_id)
    if num_reused and segments[0].start == num_reused:  # adopted exact prefix blocks: recomputed from tokens
        segments.insert(0, Segment(ADOPTED_PREFIX_STEP, 0, num_reused, is_sampled=False))
    trace = ReplayTrace(request_id, tokens[0], tokens[1], segments, {}, {})
    for e in audit_queries.replay_events(ledger, run_id, request_id):
        ids, step, layer = _ids(e["object_ids"]), e["step_id"], e["layer"]
        if e["object_kind"] == ObjectKind.EXPERT.value:
            actions = trace.experts.setdefault((step, bool(e["is_rebuild"])), ExpertActions())
            if e["tag"] == Tag.EXPERT_DEFER.value:
                actions.deferred.setdefault(layer, set()).update(ids)
            elif e["tag"] == Tag.EXPERT_LOWBIT.value:
                actions.lowbit.setdefault(layer, {}).update(dict.fromkeys(ids, int(e["bits"] or 0)))
        else:
            kv = trace.kv.setdefault(step, KVActions())
            if e["tag"] == Tag.KV_DEQUANT.value:
                kv.dequantized.setdefault(layer, {}).update(dict.fromkeys(ids, int(e["bits"] or 0)))
            elif e["tag"] == Tag.RECOMPUTE.value:
                kv.rebuilt.setdefault(layer, set()).update(ids)
    for row in kv_copy_queries.written_code_checksums(ledger, run_id, request_id):
        sums = [int(x, 16) for x in row["code_checksums"].split(",")]
        for block, checksum in zip(_ids(row["block_ids"]), sums, strict=True):
            key = (row["layer"], block, row["bits"])
            trace.code_checksums.setdefault(key, []).append((row["step_id"], checksum))
    return trace

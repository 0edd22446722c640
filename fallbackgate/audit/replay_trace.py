"""What the replay baseline repeats for one request, read back from the ledger.

The trace is built from ledger rows only (``step_requests`` and the events that name their objects), never
from engine state: a writer that dropped a step or an approximate event makes the replay diverge from what
was served, which is how the replay also checks the ledger.
"""

from __future__ import annotations

import dataclasses

from fallbackgate.engine.messages import CopyAction
from fallbackgate.engine.tags import ObjectKind, Tag
from fallbackgate.ledger import audit_queries, kv_copy_queries
from fallbackgate.ledger.db import Ledger
from fallbackgate.ledger.rows import per_layer_digests

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


@dataclasses.dataclass(frozen=True, slots=True)
class KVVersion:
    """Which K/V a step read for one block, when not the K/V its positions were written with: the block as
    the rebuild pass of step `rebuilt_at` computed it (None: as written), quantized to `bits` (0: not)."""

    bits: int
    rebuilt_at: int | None


@dataclasses.dataclass(frozen=True, slots=True)
class CopyChange:
    """One change to one of the request's KV block copies, from the copy journal (in journal order)."""

    step_id: int
    action: str
    layer: int
    block: int
    tier: str
    bits: int


Versions = dict[int, dict[int, KVVersion]]  # layer -> block -> version read


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
    copy_changes: list[CopyChange] = dataclasses.field(default_factory=list)  # the request's copy journal
    routing: dict[int, dict[int, int]] = dataclasses.field(default_factory=dict)  # step -> layer -> digest of
    # the experts its own forward routed the request's tokens to (absent: not recorded)

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

    def read_versions(self, block_size: int) -> dict[int, Versions]:
        """Per step: the version of every block its queries read other than as its positions were written.

        A block's copy holds the K/V the block had on device when the copy was written, and the device holds
        the K/V of the block's latest staging that was kept (promoted): a rebuild's, or an exactly loaded
        copy's (a dequantized block is never kept). A block on device at a write or at a read without an
        off-device action was kept at its latest staging, so walking the copy journal and the KV events in
        step order gives each read's version, without knowing which stagings were kept:

        - a block rebuilt at step s reads the rebuild pass's K/V (``rebuilt_at=s``);
        - a copy read (exactly or dequantized) has the version the block had when the copy was written
          (a rebuild after the write does not change it), also when the write happened in a step the
          request did not run in (spilled while it waited, swapped out or preempted);
        - a block read on device has the version of its latest exact or rebuilt staging.
        """
        live: dict[tuple[int, int], int] = {}  # (layer, block) -> rebuild step of its device K/V (absent: as written)
        copies: dict[tuple[int, int, str, int], int | None] = {}  # (layer, block, tier, bits) -> the same, at write
        by_step: dict[int, list[CopyChange]] = {}
        for change in self.copy_changes:
            by_step.setdefault(change.step_id, []).append(change)
        pending = sorted(by_step)  # steps with copy changes, applied in step order up to each segment
        num_applied = 0
        out: dict[int, Versions] = {}
        length = 0
        for seg in self.segments:
            while num_applied < len(pending) and pending[num_applied] < seg.step_id:  # steps it did not run in
                _apply_changes(by_step[pending[num_applied]], copies, live)
                num_applied += 1
            if num_applied < len(pending) and pending[num_applied] == seg.step_id:
                num_applied += 1
            if seg.start < length:  # a re-prefill: the blocks from its start are written again
                first = seg.start // block_size
                live = {k: v for k, v in live.items() if k[1] < first}
                copies = {k: v for k, v in copies.items() if k[1] < first}
            read = _apply_changes(by_step.get(seg.step_id, []), copies, live)
            kv = self.kv.get(seg.step_id, KVActions())
            for layer, blocks in kv.rebuilt.items():
                for block in blocks:
                    live[layer, block] = seg.step_id
            versions: Versions = {}
            for (layer, block), version in live.items():
                if block * block_size < seg.start:
                    versions.setdefault(layer, {})[block] = KVVersion(0, version)
            for layer, blocks in kv.dequantized.items():
                for block, bits in blocks.items():
                    version = read.get((layer, block, bits), live.get((layer, block)))
                    versions.setdefault(layer, {})[block] = KVVersion(bits, version)
            out[seg.step_id] = versions
            length = seg.start + seg.num_tokens
        return out


def _apply_changes(
    changes: list[CopyChange],
    copies: dict[tuple[int, int, str, int], int | None],
    live: dict[tuple[int, int], int],
) -> dict[tuple[int, int, int], int | None]:
    """Apply one step's copy changes to `copies` (and `live`: an exact read is kept on device with its copy's
    version); returns the version of each copy read, by (layer, block, bits)."""
    read: dict[tuple[int, int, int], int | None] = {}
    for c in changes:
        key, copy = (c.layer, c.block), (c.layer, c.block, c.tier, c.bits)
        if c.action == CopyAction.WRITTEN.value:
            copies[copy] = live.get(key)
        elif c.action == CopyAction.MOVED_IN.value:  # an adopted prefix block: recomputed from tokens
            copies[copy] = None
        elif c.action == CopyAction.READ.value:
            read[c.layer, c.block, c.bits] = copies.get(copy, live.get(key))
        else:  # freed, moved out
            copies.pop(copy, None)
    for (layer, block, bits), version in read.items():
        if not bits:  # an exact load: kept on device, the block holds that copy's K/V
            live.pop((layer, block), None)
            if version is not None:
                live[layer, block] = version
    return read


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
    trace.routing = {r["step_id"]: per_layer_digests(r.get("routing_digests")) for r in rows}
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
    for row in kv_copy_queries.request_copy_changes(ledger, run_id, request_id):
        for block in _ids(row["block_ids"]):
            change = CopyChange(row["step_id"], row["action"], row["layer"], block, row["tier"], int(row["bits"]))
            trace.copy_changes.append(change)
    return trace

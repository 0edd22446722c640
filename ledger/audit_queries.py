"""Read queries the audit needs beyond the gate's: a request's replay trace and the completeness counts.

Plain dicts out, parameters bound; the events table is read only through aggregates or for the few rows that
name objects (approximate and rebuild actions).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select

from fallbackgate.engine.engine import ENGINE_REQUEST_ID
from fallbackgate.engine.tags import ObjectKind, Tag
from fallbackgate.ledger.db import Ledger
from fallbackgate.ledger.models import (
    AuditTask,
    EventObjectsRow,
    EventRow,
    PositionDiffRow,
    Request,
    Step,
    StepRequest,
    VerificationRow,
)
from fallbackgate.ledger.queries import _all

_KV_BLOCK = ObjectKind.KV_BLOCK.value


def step_requests(ledger: Ledger, run_id: int, request_id: str) -> list[dict[str, Any]]:
    """One request's step rows (positions computed, sampled or not, event counts), in step order."""
    stmt = (
        select(StepRequest.__table__)
        .where(StepRequest.run_id == run_id, StepRequest.request_id == request_id)
        .order_by(StepRequest.step_id)
    )
    return _all(ledger, stmt)


def replay_events(ledger: Ledger, run_id: int, request_id: str) -> list[dict[str, Any]]:
    """One request's events that name their objects: what the replay baseline repeats."""
    o = EventObjectsRow
    cols = (o.step_id, o.layer, o.object_kind, o.tag, o.object_ids, o.bits, o.is_rebuild)
    stmt = select(*cols).where(o.run_id == run_id, o.request_id == request_id).order_by(o.step_id, o.layer)
    return _all(ledger, stmt)


def request_tokens(ledger: Ledger, run_id: int, request_id: str) -> tuple[list[int], int] | None:
    """(prompt + output token ids, number of prompt tokens) of a recorded request, or None."""
    stmt = select(Request.token_ids, Request.num_prompt_tokens).where(
        Request.run_id == run_id, Request.request_id == request_id
    )
    rows = _all(ledger, stmt)
    if not rows or rows[0]["token_ids"] is None:
        return None
    return list(rows[0]["token_ids"]), int(rows[0]["num_prompt_tokens"])


def request_reused_tokens(ledger: Ledger, run_id: int, request_id: str) -> int:
    """Prompt positions the request adopted from kept prefix blocks instead of computing them (0: none)."""
    stmt = select(Request.num_reused_tokens).where(Request.run_id == run_id, Request.request_id == request_id)
    rows = _all(ledger, stmt)
    return int(rows[0]["num_reused_tokens"] or 0) if rows else 0


def step_event_counts(ledger: Ledger, run_id: int) -> list[dict[str, Any]]:
    """Per step: the event rows the engine said it produced (``expected``) and those found (``found``)."""
    return _expected_and_found(ledger, run_id, EventRow, Step.num_events)


def _expected_and_found(ledger: Ledger, run_id: int, table: Any, expected: Any) -> list[dict[str, Any]]:
    """Per step of the run: the step row's count `expected` and the rows of `table` found for that step."""
    found = (
        select(table.step_id, func.count().label("found"))
        .where(table.run_id == run_id)
        .group_by(table.step_id)
        .subquery()
    )
    stmt = (
        select(Step.step_id, expected.label("expected"), func.coalesce(found.c.found, 0).label("found"))
        .outerjoin(found, found.c.step_id == Step.step_id)
        .where(Step.run_id == run_id)
        .order_by(Step.step_id)
    )
    return _all(ledger, stmt)


def step_request_counts(ledger: Ledger, run_id: int) -> list[dict[str, Any]]:
    """Per (step, request): the event rows and objects the engine said it produced and those found."""
    found = (
        select(
            EventRow.step_id,
            EventRow.request_id,
            func.count().label("found_events"),
            func.sum(EventRow.count).label("found_objects"),
        )
        .where(EventRow.run_id == run_id)
        .group_by(EventRow.step_id, EventRow.request_id)
        .subquery()
    )
    on = (found.c.step_id == StepRequest.step_id) & (found.c.request_id == StepRequest.request_id)
    stmt = (
        select(
            StepRequest.step_id,
            StepRequest.request_id,
            StepRequest.num_events,
            StepRequest.num_objects,
            func.coalesce(found.c.found_events, 0).label("found_events"),
            func.coalesce(found.c.found_objects, 0).label("found_objects"),
        )
        .outerjoin(found, on)
        .where(StepRequest.run_id == run_id)
        .order_by(StepRequest.step_id, StepRequest.request_id)
    )
    return _all(ledger, stmt)


def step_resident_totals(ledger: Ledger, run_id: int) -> list[dict[str, Any]]:
    """Per step: the resident expert uses and device KV reads the engine counted for it (NULL before 0010)."""
    stmt = (
        select(Step.step_id, Step.num_resident_expert_uses, Step.num_resident_kv_reads)
        .where(Step.run_id == run_id)
        .order_by(Step.step_id)
    )
    return _all(ledger, stmt)


def step_request_uses(ledger: Ledger, run_id: int) -> list[dict[str, Any]]:
    """Per (step, request): tokens, rebuild objects and the counted resident uses (total, per layer; KV reads
    per layer), in step order."""
    s = StepRequest
    cols = (
        s.step_id,
        s.request_id,
        s.num_tokens,
        s.rebuild_objects,
        s.num_resident_expert_uses,
        s.resident_expert_uses,
        s.kv_resident_reads,
    )
    return _all(ledger, select(*cols).where(s.run_id == run_id).order_by(s.step_id, s.request_id))


def expert_event_objects(ledger: Ledger, run_id: int) -> list[dict[str, Any]]:
    """Expert objects of the events per step × request × layer (every non-counted expert use)."""
    e = EventRow
    keys = (e.step_id, e.request_id, e.layer)
    stmt = (
        select(*keys, func.sum(e.count).label("objects"))
        .where(e.run_id == run_id, e.object_kind == ObjectKind.EXPERT.value)
        .group_by(*keys)
    )
    return _all(ledger, stmt)


def moved_bytes(ledger: Ledger, run_id: int) -> list[dict[str, Any]]:
    """Events that moved bytes, aggregated per step × request × layer × kind × tag."""
    keys = (EventRow.step_id, EventRow.request_id, EventRow.layer, EventRow.object_kind, EventRow.tag)
    stmt = (
        select(*keys, func.sum(EventRow.count).label("objects"), func.sum(EventRow.bytes_moved).label("bytes_moved"))
        .where(EventRow.run_id == run_id, EventRow.bytes_moved > 0)
        .group_by(*keys)
        .order_by(EventRow.step_id)
    )
    return _all(ledger, stmt)


def steps_referenced_but_absent(ledger: Ledger, run_id: int) -> list[int]:
    """Step ids that position diffs say sampled a token but that have no step row."""
    recorded = select(Step.step_id).where(Step.run_id == run_id)
    stmt = (
        select(PositionDiffRow.step_id)
        .where(
            PositionDiffRow.run_id == run_id,
            PositionDiffRow.step_id.is_not(None),
            PositionDiffRow.step_id.not_in(recorded.scalar_subquery()),
        )
        .distinct()
        .order_by(PositionDiffRow.step_id)
    )
    return [r["step_id"] for r in _all(ledger, stmt)]


def failed_verifications(ledger: Ledger, run_id: int) -> list[dict[str, Any]]:
    """Weight copies of the run that did not match the checkpoint, in check order."""
    stmt = (
        select(VerificationRow.__table__)
        .where(VerificationRow.run_id == run_id, VerificationRow.passed.is_(False))
        .order_by(VerificationRow.id)
    )
    return _all(ledger, stmt)


def num_pending_audits(ledger: Ledger, run_id: int) -> int:
    """Deferred request audits of the run not done yet (the run's own task excluded)."""
    stmt = select(func.count()).where(
        AuditTask.run_id == run_id, AuditTask.request_id != "*run*", AuditTask.state != "done"
    )
    with ledger.engine.connect() as conn:
        return int(conn.execute(stmt).scalar_one())


def kv_resident_reads(ledger: Ledger, run_id: int, request_id: str, step_id: int) -> list[int]:
    """KV blocks the request read on device at the step, per layer from 0 (empty when none)."""
    stmt = select(StepRequest.kv_resident_reads).where(
        StepRequest.run_id == run_id, StepRequest.request_id == request_id, StepRequest.step_id == step_id
    )
    rows = _all(ledger, stmt)
    text = rows[0]["kv_resident_reads"] if rows else None
    return [int(x) for x in text.split(",")] if text else []


def step_request_positions(ledger: Ledger, run_id: int) -> list[dict[str, Any]]:
    """Every step_requests row of the run (positions, sampling, rebuild-pass objects), by request then step."""
    s = StepRequest
    cols = (s.step_id, s.request_id, s.start_position, s.num_tokens, s.is_sampled, s.rebuild_objects)
    stmt = select(*cols).where(s.run_id == run_id).order_by(s.request_id, s.step_id)
    return _all(ledger, stmt)


def step_row_counts(ledger: Ledger, run_id: int) -> list[dict[str, Any]]:
    """Per step: the requests the engine scheduled (``expected``) and the step_requests rows found."""
    return _expected_and_found(ledger, run_id, StepRequest, Step.num_requests)


def _pairs_without_row(ledger: Ledger, run_id: int, table: Any) -> list[tuple[int, str]]:
    """(step, request) pairs of `table`'s rows of the run that have no step_requests row."""
    row = (
        select(StepRequest.step_id)
        .where(
            StepRequest.run_id == run_id,
            StepRequest.step_id == table.step_id,
            StepRequest.request_id == table.request_id,
        )
        .exists()
    )
    stmt = (
        select(table.step_id, table.request_id)
        .where(table.run_id == run_id, table.step_id.is_not(None), table.request_id != ENGINE_REQUEST_ID, ~row)
        .distinct()
        .order_by(table.step_id, table.request_id)
    )
    return [(int(r["step_id"]), str(r["request_id"])) for r in _all(ledger, stmt)]


def pairs_without_step_request(ledger: Ledger, run_id: int) -> list[tuple[int, str]]:
    """(step, request) pairs that events or position diffs (a sampled token) name but no step_requests row has."""
    pairs = set(_pairs_without_row(ledger, run_id, EventRow))
    pairs |= set(_pairs_without_row(ledger, run_id, PositionDiffRow))
    return sorted(pairs)


def requests_without_row(ledger: Ledger, run_id: int) -> list[str]:
    """Request ids that events or step_requests rows name but that have no requests row (the engine's own
    events, prefetches, belong to no request)."""
    known = select(Request.request_id).where(Request.run_id == run_id).scalar_subquery()
    ids: set[str] = set()
    for table in (EventRow, StepRequest):
        stmt = (
            select(table.request_id)
            .where(table.run_id == run_id, table.request_id.not_in(known), table.request_id != ENGINE_REQUEST_ID)
            .distinct()
        )
        ids |= {str(r["request_id"]) for r in _all(ledger, stmt)}
    return sorted(ids)


def observe_notes(ledger: Ledger, run_id: int) -> list[dict[str, Any]]:
    """Objects per event note that says what an observe-mode controller would have served."""
    stmt = (
        select(EventRow.note, func.sum(EventRow.count).label("objects"))
        .where(EventRow.run_id == run_id, EventRow.note.like("%observe: would serve %"))
        .group_by(EventRow.note)
    )
    return _all(ledger, stmt)


def kv_events(ledger: Ledger, run_id: int) -> list[dict[str, Any]]:
    """Every off-device KV event of the run (exact_load, kv_dequant, recompute), in step order."""
    e = EventRow
    cols = (e.step_id, e.request_id, e.layer, e.tag, e.count, e.bytes_moved, e.source_tier, e.note)
    stmt = (
        select(*cols)
        .where(e.run_id == run_id, e.object_kind == _KV_BLOCK, e.tag != Tag.RESIDENT.value)
        .order_by(e.step_id, e.request_id, e.layer)
    )
    return _all(ledger, stmt)


def kv_event_objects(ledger: Ledger, run_id: int) -> list[dict[str, Any]]:
    """KV events that name their blocks (kv_dequant and staged recompute), with bits and pass."""
    o = EventObjectsRow
    cols = (o.step_id, o.request_id, o.layer, o.tag, o.bits, o.is_rebuild, o.object_ids)
    stmt = select(*cols).where(o.run_id == run_id, o.object_kind == _KV_BLOCK).order_by(o.step_id, o.layer)
    return _all(ledger, stmt)


def requests_with_kv_events(ledger: Ledger, run_id: int) -> set[str]:
    """Requests that read a KV block anywhere but where it lives on device (exact_load, kv_dequant, recompute):
    audited whatever the sample rate."""
    stmt = (
        select(EventRow.request_id)
        .where(EventRow.run_id == run_id, EventRow.object_kind == _KV_BLOCK, EventRow.tag != Tag.RESIDENT.value)
        .distinct()
    )
    return {str(r["request_id"]) for r in _all(ledger, stmt)}

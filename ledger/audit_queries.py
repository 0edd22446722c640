"""Read queries the audit needs beyond the gate's: a request's replay trace and the completeness counts.

Plain dicts out, parameters bound; the events table is read only through aggregates or for the few rows that
name objects (approximate and rebuild actions).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select

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


def step_event_counts(ledger: Ledger, run_id: int) -> list[dict[str, Any]]:
    """Per step: the event rows the engine said it produced (``expected``) and those found (``found``)."""
    found = (
        select(EventRow.step_id, func.count().label("found"))
        .where(EventRow.run_id == run_id)
        .group_by(EventRow.step_id)
        .subquery()
    )
    stmt = (
        select(Step.step_id, Step.num_events.label("expected"), func.coalesce(found.c.found, 0).label("found"))
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

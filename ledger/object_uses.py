"""Every object a run used, from the events and from the counts the step rows carry instead of events.

Resident expert uses (exact, zero bytes) are counts on the step_requests rows (``num_resident_expert_uses``
in total, ``resident_expert_uses`` per layer), not event rows. Queries that aggregate objects per tag or
exactness read :func:`object_uses`, the union of both, so the counts weigh exactly as events did.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, Float, Integer, Subquery, Text, cast, literal, select, union_all

from fallbackgate.engine.tags import Exactness, ObjectKind, Tag
from fallbackgate.ledger.db import Ledger
from fallbackgate.ledger.models import EventRow, StepRequest
from fallbackgate.ledger.rows import per_layer_counts

RESIDENT_EXPERT = {
    "object_kind": ObjectKind.EXPERT.value,
    "tag": Tag.RESIDENT.value,
    "exactness": Exactness.EXACT.value,
}
"""The object kind, tag and exactness of the counted uses."""


def object_uses(
    event_where: ColumnElement[bool] | None = None, count_where: ColumnElement[bool] | None = None
) -> Subquery:
    """Events (``event_where`` on EventRow) and counted resident uses (``count_where`` on StepRequest) as one
    table: run_id, step_id, request_id, object_kind, tag, exactness, count, bytes_moved, modeled_s,
    predicted_cost, is_event (1 for an event row, 0 for a step_requests count)."""
    e, s = EventRow, StepRequest
    events = select(
        e.run_id,
        e.step_id,
        e.request_id,
        e.object_kind,
        e.tag,
        e.exactness,
        e.count,
        e.bytes_moved,
        e.modeled_s,
        e.predicted_cost,
        literal(1, Integer).label("is_event"),
    )
    counts = select(
        s.run_id,
        s.step_id,
        s.request_id,
        cast(literal(RESIDENT_EXPERT["object_kind"]), Text).label("object_kind"),
        cast(literal(RESIDENT_EXPERT["tag"]), Text).label("tag"),
        cast(literal(RESIDENT_EXPERT["exactness"]), Text).label("exactness"),
        s.num_resident_expert_uses.label("count"),
        literal(0, Integer).label("bytes_moved"),
        literal(0.0, Float).label("modeled_s"),
        literal(0.0, Float).label("predicted_cost"),
        literal(0, Integer).label("is_event"),
    ).where(s.num_resident_expert_uses > 0)
    if event_where is not None:
        events = events.where(event_where)
    if count_where is not None:
        counts = counts.where(count_where)
    return union_all(events, counts).subquery("object_uses")


def resident_by_layer(ledger: Ledger, run_id: int, request_id: str, step_id: int | None = None) -> list[dict[str, Any]]:
    """One request's counted resident expert uses as step × layer rows (step_id, layer, objects), in order."""
    s = StepRequest
    stmt = select(s.step_id, s.resident_expert_uses).where(
        s.run_id == run_id, s.request_id == request_id, s.num_resident_expert_uses > 0
    )
    if step_id is not None:
        stmt = stmt.where(s.step_id == step_id)
    with ledger.engine.connect() as conn:
        rows = conn.execute(stmt.order_by(s.step_id)).all()
    return [
        {"step_id": step, "layer": layer, "objects": n}
        for step, text in rows
        for layer, n in sorted(per_layer_counts(text).items())
    ]

"""Read queries behind the dashboard's request drill-down: one request's tags, timeline and verdict."""

from __future__ import annotations

from typing import Any

from sqlalchemy import BigInteger, case, cast, func, select

from fallbackgate.engine.tags import Exactness
from fallbackgate.ledger.dashboard_queries import _float
from fallbackgate.ledger.db import Ledger
from fallbackgate.ledger.models import (
    EventRow,
    Request,
    Step,
    VerdictRow,
)
from fallbackgate.ledger.queries import _all, served_events


def run_request_ids(ledger: Ledger, run_id: int, request_classes: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The requests of one run (id, class, verdict), optionally only those of ``request_classes``."""
    stmt = select(Request.request_id, Request.request_class, Request.verdict).where(Request.run_id == run_id)
    if request_classes:
        stmt = stmt.where(Request.request_class.in_(request_classes))
    return _all(ledger, stmt.order_by(Request.id))


def _severity() -> Any:
    approximate, equivalent = Exactness.APPROXIMATE.value, Exactness.EQUIVALENT.value
    return case((EventRow.exactness == approximate, 2), (EventRow.exactness == equivalent, 1), else_=0)


def request_tag_grid(ledger: Ledger, run_id: int, request_id: str) -> list[dict[str, Any]]:
    """One request's step × layer × object kind cells: the least exact tag used there (ties: most
    objects, then name), the objects under that tag, all objects in the cell and how many tags."""
    per_tag = (
        select(
            EventRow.step_id,
            EventRow.layer,
            EventRow.object_kind,
            EventRow.tag,
            EventRow.exactness,
            func.max(_severity()).label("severity"),
            func.sum(EventRow.count).label("objects"),
        )
        .where(EventRow.run_id == run_id, EventRow.request_id == request_id)
        .group_by(EventRow.step_id, EventRow.layer, EventRow.object_kind, EventRow.tag, EventRow.exactness)
        .subquery()
    )
    cell = (per_tag.c.step_id, per_tag.c.layer, per_tag.c.object_kind)
    ranked = select(
        per_tag,
        func.row_number()
        .over(partition_by=cell, order_by=(per_tag.c.severity.desc(), per_tag.c.objects.desc(), per_tag.c.tag))
        .label("rn"),
        cast(func.sum(per_tag.c.objects).over(partition_by=cell), BigInteger).label("cell_objects"),
        func.count().over(partition_by=cell).label("cell_tags"),
    ).subquery()
    stmt = (
        select(*[c for c in ranked.c if c.name not in ("rn", "severity")])
        .where(ranked.c.rn == 1)
        .order_by(ranked.c.step_id, ranked.c.layer, ranked.c.object_kind)
    )
    return _all(ledger, stmt)


def request_step_timeline(ledger: Ledger, run_id: int, request_id: str) -> list[dict[str, Any]]:
    """The steps one request took part in, with measured and modeled seconds, cumulative over its
    steps, its approximate tags' predicted cost per step and cumulative, and whether it was observe-only."""
    ev = (
        select(
            EventRow.step_id,
            _float(
                func.sum(case((EventRow.exactness == Exactness.APPROXIMATE.value, EventRow.predicted_cost), else_=0.0))
            ).label("predicted_cost"),
        )
        .where(EventRow.run_id == run_id, EventRow.request_id == request_id)
        .group_by(EventRow.step_id)
        .subquery()
    )
    order = Step.step_id
    stmt = (
        select(
            Step.step_id,
            Step.kind,
            Step.is_observe,
            Step.wall_s,
            Step.modeled_s,
            func.sum(Step.wall_s).over(order_by=order).label("cum_wall_s"),
            func.sum(Step.modeled_s).over(order_by=order).label("cum_modeled_s"),
            ev.c.predicted_cost,
            func.sum(ev.c.predicted_cost).over(order_by=order).label("cum_predicted_cost"),
        )
        .join(ev, ev.c.step_id == Step.step_id)
        .where(Step.run_id == run_id)
        .order_by(order)
    )
    return _all(ledger, stmt)


def request_verdict(ledger: Ledger, run_id: int, request_id: str) -> dict[str, Any] | None:
    """The newest recorded verdict of one request, or None."""
    stmt = (
        select(VerdictRow.__table__)
        .where(VerdictRow.run_id == run_id, VerdictRow.request_id == request_id)
        .order_by(VerdictRow.id.desc())
        .limit(1)
    )
    rows = _all(ledger, stmt)
    return rows[0] if rows else None


def request_objects_by_exactness(ledger: Ledger, run_id: int, request_id: str) -> dict[str, int]:
    """One request's objects per exactness (approximate tags of observe steps excluded, as in
    :func:`~fallbackgate.ledger.queries.request_exactness`)."""
    stmt = (
        select(EventRow.exactness, func.sum(EventRow.count).label("objects"))
        .where(served_events(run_id), EventRow.request_id == request_id)
        .group_by(EventRow.exactness)
    )
    return {r["exactness"]: int(r["objects"]) for r in _all(ledger, stmt)}

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
    StepRequest,
    VerdictRow,
)
from fallbackgate.ledger.object_uses import RESIDENT_EXPERT, object_uses, resident_by_layer
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
    objects, then name), the objects under that tag, all objects in the cell and how many tags (counted
    resident expert uses included)."""
    stmt = (
        select(
            EventRow.step_id,
            EventRow.layer,
            EventRow.object_kind,
            EventRow.tag,
            EventRow.exactness,
            func.max(_severity()).label("severity"),
            cast(func.sum(EventRow.count), BigInteger).label("objects"),
        )
        .where(EventRow.run_id == run_id, EventRow.request_id == request_id)
        .group_by(EventRow.step_id, EventRow.layer, EventRow.object_kind, EventRow.tag, EventRow.exactness)
    )
    cells: dict[tuple[int, int, str], dict[str, dict[str, Any]]] = {}
    for r in _all(ledger, stmt):
        cells.setdefault((r["step_id"], r["layer"], r["object_kind"]), {})[r["tag"]] = r
    for r in resident_by_layer(ledger, run_id, request_id):
        key = (r["step_id"], r["layer"], RESIDENT_EXPERT["object_kind"])
        tags = cells.setdefault(key, {})
        row = tags.setdefault(RESIDENT_EXPERT["tag"], {**r, **RESIDENT_EXPERT, "severity": 0, "objects": 0})
        row["objects"] += r["objects"]
    out = []
    for key in sorted(cells):
        tags = cells[key].values()
        top = min(tags, key=lambda t: (-t["severity"], -t["objects"], t["tag"]))
        cell = {k: v for k, v in top.items() if k != "severity"}
        out.append({**cell, "cell_objects": sum(t["objects"] for t in tags), "cell_tags": len(tags)})
    return out


def request_step_timeline(ledger: Ledger, run_id: int, request_id: str) -> list[dict[str, Any]]:
    """The steps one request took part in (its step_requests rows), with measured and modeled seconds,
    cumulative over its steps, its approximate tags' predicted cost per step and cumulative, and whether it
    was observe-only."""
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
    took_part = (
        select(StepRequest.step_id).where(StepRequest.run_id == run_id, StepRequest.request_id == request_id).subquery()
    )
    order, cost = Step.step_id, func.coalesce(ev.c.predicted_cost, 0.0)
    stmt = (
        select(
            Step.step_id,
            Step.kind,
            Step.is_observe,
            Step.wall_s,
            Step.modeled_s,
            func.sum(Step.wall_s).over(order_by=order).label("cum_wall_s"),
            func.sum(Step.modeled_s).over(order_by=order).label("cum_modeled_s"),
            cost.label("predicted_cost"),
            func.sum(cost).over(order_by=order).label("cum_predicted_cost"),
        )
        .join(took_part, took_part.c.step_id == Step.step_id)
        .outerjoin(ev, ev.c.step_id == Step.step_id)
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
    """One request's objects per exactness (its served events, as in
    :func:`~fallbackgate.ledger.queries.request_exactness`)."""
    u = object_uses(
        served_events(run_id) & (EventRow.request_id == request_id),
        (StepRequest.run_id == run_id) & (StepRequest.request_id == request_id),
    )
    stmt = select(u.c.exactness, func.sum(u.c.count).label("objects")).group_by(u.c.exactness)
    return {r["exactness"]: int(r["objects"]) for r in _all(ledger, stmt)}

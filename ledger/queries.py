"""Read queries for the gate, dashboard and calibration; aggregation happens in SQL.

Every function takes an open :class:`~fallbackgate.ledger.db.Ledger` and returns plain dicts. Parameters are
bound, never formatted into SQL. A stored status of "running" is reported as "incomplete": a run
whose process died never reaches "complete" or "failed".
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, Select, case, func, select

from fallbackgate.engine.tags import Exactness
from fallbackgate.ledger.db import Ledger
from fallbackgate.ledger.models import (
    EventRow,
    PositionDiffRow,
    Request,
    RequestStatRow,
    Run,
    Step,
    StepRequest,
    VerdictRow,
)
from fallbackgate.ledger.object_uses import RESIDENT_EXPERT, object_uses, resident_by_layer
from fallbackgate.ledger.vocabulary import EXACTNESS_NAMES


def _all(ledger: Ledger, stmt: Select[Any]) -> list[dict[str, Any]]:
    with ledger.engine.connect() as conn:
        return [dict(r) for r in conn.execute(stmt).mappings()]


def reported_status(stored: str) -> str:
    """The status queries report: "running" (never finished) becomes "incomplete"."""
    return "incomplete" if stored == "running" else stored


def get_run(ledger: Ledger, run_id: int) -> dict[str, Any] | None:
    """One run's row (status as reported), or None when no such run exists."""
    rows = _all(ledger, select(Run.__table__).where(Run.id == run_id))
    if not rows:
        return None
    rows[0]["status"] = reported_status(rows[0]["status"])
    return rows[0]


def latest_run_id(ledger: Ledger) -> int | None:
    """The id of the most recently started run, or None for an empty ledger."""
    with ledger.engine.connect() as conn:
        return conn.execute(select(Run.id).order_by(Run.started_at.desc(), Run.id.desc()).limit(1)).scalar()


def expert_room_by_step(ledger: Ledger, run_id: int) -> dict[int, int]:
    """Step id -> the fast-tier bytes the run's expert copies held after that step."""
    stmt = select(Step.step_id, Step.device_bytes_expert).where(Step.run_id == run_id)
    with ledger.engine.connect() as conn:
        return {int(step_id): int(num_bytes) for step_id, num_bytes in conn.execute(stmt)}


def list_runs(ledger: Ledger, limit: int = 100) -> list[dict[str, Any]]:
    """Newest runs first, each with its object counts per exactness (``objects_exact``, ...)."""
    u = object_uses()
    mix = [
        func.coalesce(func.sum(case((u.c.exactness == e, u.c.count), else_=0)), 0).label(f"objects_{e}")
        for e in EXACTNESS_NAMES
    ]
    events = select(u.c.run_id, *mix).group_by(u.c.run_id).subquery()
    stmt = (
        select(
            Run.id,
            Run.started_at,
            Run.finished_at,
            Run.status,
            Run.model_path,
            Run.controller,
            Run.mode,
            *[func.coalesce(events.c[f"objects_{e}"], 0).label(f"objects_{e}") for e in EXACTNESS_NAMES],
        )
        .outerjoin(events, events.c.run_id == Run.id)
        .order_by(Run.started_at.desc(), Run.id.desc())
        .limit(limit)
    )
    rows = _all(ledger, stmt)
    for r in rows:
        r["status"] = reported_status(r["status"])
    return rows


def run_tag_counts(ledger: Ledger, run_id: int) -> list[dict[str, Any]]:
    """Per tag and object kind: event rows, objects (counted resident uses included), bytes moved, modeled
    seconds, predicted cost."""
    u = object_uses(EventRow.run_id == run_id, StepRequest.run_id == run_id)
    stmt = (
        select(
            u.c.tag,
            u.c.exactness,
            u.c.object_kind,
            func.sum(u.c.is_event).label("events"),
            func.sum(u.c.count).label("objects"),
            func.sum(u.c.bytes_moved).label("bytes_moved"),
            func.sum(u.c.modeled_s).label("modeled_s"),
            func.sum(u.c.predicted_cost).label("predicted_cost"),
        )
        .group_by(u.c.tag, u.c.exactness, u.c.object_kind)
        .order_by(u.c.tag, u.c.object_kind)
    )
    return _all(ledger, stmt)


def request_summaries(ledger: Ledger, run_id: int) -> list[dict[str, Any]]:
    """Each request of a run with its timings, budget, verdict and diff statistics (None if unaudited)."""
    stats = RequestStatRow.__table__.c
    cols = [c for c in stats if c.name not in ("run_id", "request_id")]
    stmt = (
        select(Request.__table__, *cols)
        .outerjoin(
            RequestStatRow,
            (RequestStatRow.run_id == Request.run_id) & (RequestStatRow.request_id == Request.request_id),
        )
        .where(Request.run_id == run_id)
        .order_by(Request.id)
    )
    return _all(ledger, stmt)


def served_events(run_id: int) -> ColumnElement[bool]:
    """The condition on a run's events that keeps what was served: every recorded event. An observe step
    records the tag it served (exact, or a rebuild) and notes in ``note`` what the controller would have
    served; the approximate tags it records were served (a fault's forced ``expert_defer``), so they count."""
    return EventRow.run_id == run_id


def request_exactness(ledger: Ledger, run_id: int) -> dict[str, dict[str, int]]:
    """request id -> {exactness -> objects}, from the served events (:func:`served_events`) and the counted
    resident uses."""
    u = object_uses(served_events(run_id), StepRequest.run_id == run_id)
    stmt = select(u.c.request_id, u.c.exactness, func.sum(u.c.count).label("objects")).group_by(
        u.c.request_id, u.c.exactness
    )
    out: dict[str, dict[str, int]] = {}
    for r in _all(ledger, stmt):
        out.setdefault(r["request_id"], {})[r["exactness"]] = int(r["objects"])
    return out


def request_tags(ledger: Ledger, run_id: int) -> dict[str, dict[str, int]]:
    """request id -> {tag -> objects} over the whole run (counted resident uses included)."""
    u = object_uses(EventRow.run_id == run_id, StepRequest.run_id == run_id)
    stmt = select(u.c.request_id, u.c.tag, func.sum(u.c.count).label("objects")).group_by(u.c.request_id, u.c.tag)
    out: dict[str, dict[str, int]] = {}
    for r in _all(ledger, stmt):
        out.setdefault(r["request_id"], {})[r["tag"]] = int(r["objects"])
    return out


def request_events(ledger: Ledger, run_id: int, request_id: str, step_id: int | None = None) -> list[dict[str, Any]]:
    """One request's events as step × layer × tag (objects, bytes, predicted cost), in step/layer order,
    counted resident expert uses included (one row per step × layer)."""
    stmt = select(
        EventRow.step_id,
        EventRow.layer,
        EventRow.object_kind,
        EventRow.tag,
        EventRow.exactness,
        func.sum(EventRow.count).label("objects"),
        func.sum(EventRow.bytes_moved).label("bytes_moved"),
        func.sum(EventRow.predicted_cost).label("predicted_cost"),
    ).where(EventRow.run_id == run_id, EventRow.request_id == request_id)
    if step_id is not None:
        stmt = stmt.where(EventRow.step_id == step_id)
    stmt = stmt.group_by(
        EventRow.step_id,
        EventRow.layer,
        EventRow.object_kind,
        EventRow.tag,
        EventRow.exactness,
    )
    rows = _all(ledger, stmt)
    for r in resident_by_layer(ledger, run_id, request_id, step_id):
        rows.append({**r, **RESIDENT_EXPERT, "bytes_moved": 0, "predicted_cost": 0.0})
    return sorted(rows, key=lambda r: (r["step_id"], r["layer"], r["tag"], r["object_kind"]))


def position_diffs(ledger: Ledger, run_id: int, request_id: str) -> list[dict[str, Any]]:
    """One request's per-position diffs, in position order."""
    stmt = (
        select(PositionDiffRow.__table__)
        .where(PositionDiffRow.run_id == run_id, PositionDiffRow.request_id == request_id)
        .order_by(PositionDiffRow.position)
    )
    return _all(ledger, stmt)


def verdicts(ledger: Ledger, run_id: int) -> list[dict[str, Any]]:
    """Recorded verdicts of a run (run-level first)."""
    stmt = select(VerdictRow.__table__).where(VerdictRow.run_id == run_id)
    return _all(ledger, stmt.order_by(VerdictRow.request_id.is_not(None), VerdictRow.id))


def drift(ledger: Ledger, limit: int = 100) -> list[dict[str, Any]]:
    """Per run (oldest first): mean and max KL, top-1 agreement over its audited requests."""
    stmt = (
        select(
            Run.id.label("run_id"),
            Run.started_at,
            func.count(RequestStatRow.request_id).label("audited_requests"),
            func.avg(RequestStatRow.mean_kl).label("mean_kl"),
            func.max(RequestStatRow.max_kl).label("max_kl"),
            func.avg(RequestStatRow.top1_agreement).label("top1_agreement"),
        )
        .join(RequestStatRow, RequestStatRow.run_id == Run.id)
        .group_by(Run.id, Run.started_at)
        .order_by(Run.started_at.desc(), Run.id.desc())
        .limit(limit)
    )
    return list(reversed(_all(ledger, stmt)))


def calibration_pairs(ledger: Ledger, run_id: int | None = None, tag: str | None = None) -> list[dict[str, Any]]:
    """Predicted cost (events of a request's step, per tag and layer) next to the measured KL of the
    position that step produced: the data a per-tag, per-layer cost calibration is fitted on."""
    ev = (
        select(
            EventRow.run_id,
            EventRow.request_id,
            EventRow.step_id,
            EventRow.tag,
            EventRow.layer,
            func.sum(EventRow.predicted_cost).label("predicted"),
        )
        .where(EventRow.exactness == Exactness.APPROXIMATE.value)
        .group_by(
            EventRow.run_id,
            EventRow.request_id,
            EventRow.step_id,
            EventRow.tag,
            EventRow.layer,
        )
    )
    if run_id is not None:
        ev = ev.where(EventRow.run_id == run_id)
    if tag is not None:
        ev = ev.where(EventRow.tag == tag)
    sub = ev.subquery()
    pd = PositionDiffRow
    stmt = (
        select(sub, pd.position, pd.kl.label("measured_kl"))
        .join(
            pd,
            (pd.run_id == sub.c.run_id) & (pd.request_id == sub.c.request_id) & (pd.step_id == sub.c.step_id),
        )
        .order_by(sub.c.run_id, sub.c.request_id, sub.c.step_id, sub.c.layer)
    )
    return _all(ledger, stmt)

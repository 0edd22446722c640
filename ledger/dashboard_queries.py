"""Read queries behind the dashboard's pages; filters are bound parameters, aggregation stays in SQL."""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

from sqlalchemy import Float, Select, case, cast, func, select, true, tuple_

from fallbackgate.engine.tags import Exactness
from fallbackgate.ledger.db import Ledger
from fallbackgate.ledger.models import (
    Calibration,
    EventRow,
    PositionDiffRow,
    Request,
    Run,
    StepRequest,
    VerdictRow,
)
from fallbackgate.ledger.object_uses import object_uses
from fallbackgate.ledger.queries import _all, reported_status
from fallbackgate.ledger.vocabulary import EXACTNESS_NAMES

# --- dashboard read queries (issue 7): filters are bound parameters, aggregation stays in SQL ---


@dataclasses.dataclass(frozen=True)
class RunFilter:
    """Which runs (and requests) a dashboard view covers; empty tuples and None mean "all"."""

    policies: tuple[str, ...] = ()  # POLICY_LABEL values
    models: tuple[str, ...] = ()  # runs.model_path values
    request_classes: tuple[str, ...] = ()  # requests.request_class values
    since: dt.datetime | None = None  # runs started at or after
    until: dt.datetime | None = None  # runs started before


#: A run's policy as the dashboard labels it: the policy file's name, or the controller for runs without one.
POLICY_LABEL = func.coalesce(Run.policy_name, Run.controller)


def _float(expr: Any) -> Any:
    """``expr`` as a float column (PostgreSQL would return NUMERIC, read as Decimal, for 1.0-literal sums)."""
    return cast(expr, Float)


def _run_ids(f: RunFilter) -> Select[Any]:
    """Ids of the runs that pass ``f`` (a run passes the class filter when it has such a request)."""
    stmt = select(Run.id)
    if f.policies:
        stmt = stmt.where(POLICY_LABEL.in_(f.policies))
    if f.models:
        stmt = stmt.where(Run.model_path.in_(f.models))
    if f.since is not None:
        stmt = stmt.where(Run.started_at >= f.since)
    if f.until is not None:
        stmt = stmt.where(Run.started_at < f.until)
    if f.request_classes:
        stmt = stmt.where(Run.id.in_(select(Request.run_id).where(Request.request_class.in_(f.request_classes))))
    return stmt


def _class_requests(f: RunFilter) -> Select[Any]:
    """(run_id, request_id) of the requests of the filter's classes."""
    return select(Request.run_id, Request.request_id).where(Request.request_class.in_(f.request_classes))


def _in_classes(f: RunFilter, run_col: Any, request_col: Any) -> Any:
    """A condition keeping rows of requests in the filter's classes (true when no class filter)."""
    if not f.request_classes:
        return true()
    return tuple_(run_col, request_col).in_(_class_requests(f))


def filter_options(ledger: Ledger) -> dict[str, Any]:
    """Distinct policies (see :data:`POLICY_LABEL`), models and request classes, and the first/last run start."""
    with ledger.engine.connect() as conn:
        first, last = conn.execute(select(func.min(Run.started_at), func.max(Run.started_at))).one()
        return {
            "policies": list(conn.execute(select(POLICY_LABEL).distinct().order_by(POLICY_LABEL)).scalars()),
            "models": list(conn.execute(select(Run.model_path).distinct().order_by(Run.model_path)).scalars()),
            "request_classes": list(
                conn.execute(select(Request.request_class).distinct().order_by(Request.request_class)).scalars()
            ),
            "first_started_at": first,
            "last_started_at": last,
        }


def _slo_target(metric: str) -> Any:
    """An SLO target in seconds from ``requests.slo``: ``<metric>_s``, else ``<metric>_ms`` / 1000."""
    return func.coalesce(Request.slo[f"{metric}_s"].as_float(), Request.slo[f"{metric}_ms"].as_float() / 1000.0)


def _slo_columns() -> list[Any]:
    """Per-run SLO counts: requests with an SLO, and those meeting it measured and modeled."""
    ttft, tpot = _slo_target("ttft"), _slo_target("tpot")
    has_slo = ttft.is_not(None) | tpot.is_not(None)

    def met(ttft_col: Any, tpot_col: Any) -> Any:
        ok_ttft = ttft.is_(None) | (ttft_col <= ttft)
        ok_tpot = tpot.is_(None) | tpot_col.is_(None) | (tpot_col <= tpot)
        return func.sum(case((has_slo & ok_ttft & ok_tpot, 1), else_=0))

    return [
        func.count().label("requests"),
        func.sum(case((has_slo, 1), else_=0)).label("slo_requests"),
        met(Request.ttft_s, Request.tpot_s).label("slo_met"),
        met(Request.modeled_ttft_s, Request.modeled_tpot_s).label("slo_met_modeled"),
    ]


def _run_verdicts() -> Any:
    """Subquery: the newest run-level verdict (``passed``) per run."""
    newest = select(func.max(VerdictRow.id)).where(VerdictRow.request_id.is_(None)).group_by(VerdictRow.run_id)
    return select(VerdictRow.run_id, VerdictRow.passed, VerdictRow.reason).where(VerdictRow.id.in_(newest)).subquery()


def overview_runs(ledger: Ledger, f: RunFilter, limit: int = 500, objects: bool = True) -> list[dict[str, Any]]:
    """Runs passing ``f``, newest first: policy, model, verdict, SLO counts, objects per exactness.

    SLO targets come from each request's ``slo`` (``ttft_s``/``tpot_s`` or ``ttft_ms``/``tpot_ms``); a
    request meets its SLO when its TTFT and TPOT are within the targets it has. With a class filter,
    only requests (and their events) of those classes count. ``objects=False`` leaves out the
    per-exactness object counts (no pass over the events; :func:`tag_mix` has them per tag).
    """
    ids = _run_ids(f).scalar_subquery()
    req_where = [Request.run_id.in_(ids)]
    if f.request_classes:
        req_where.append(Request.request_class.in_(f.request_classes))
    rq = select(Request.run_id, *_slo_columns()).where(*req_where).group_by(Request.run_id).subquery()
    vd = _run_verdicts()
    stmt = (
        select(
            Run.id.label("run_id"),
            Run.started_at,
            Run.status,
            POLICY_LABEL.label("policy"),
            Run.controller.label("controller"),
            Run.mode,
            Run.model_path.label("model"),
            case((vd.c.passed.is_(None), None), (vd.c.passed, "pass"), else_="fail").label("verdict"),
            func.coalesce(rq.c.requests, 0).label("requests"),
            func.coalesce(rq.c.slo_requests, 0).label("slo_requests"),
            _float(rq.c.slo_met / func.nullif(_float(rq.c.slo_requests), 0)).label("slo_attainment"),
            _float(rq.c.slo_met_modeled / func.nullif(_float(rq.c.slo_requests), 0)).label("slo_attainment_modeled"),
        )
        .outerjoin(rq, rq.c.run_id == Run.id)
        .outerjoin(vd, vd.c.run_id == Run.id)
        .where(Run.id.in_(ids))
        .order_by(Run.started_at.desc(), Run.id.desc())
        .limit(limit)
    )
    if objects:
        per_tag = _tag_mix(f).subquery()
        mix = [
            func.sum(case((per_tag.c.exactness == e, per_tag.c.objects), else_=0)).label(f"objects_{e}")
            for e in EXACTNESS_NAMES
        ]
        ev = select(per_tag.c.run_id, *mix).group_by(per_tag.c.run_id).subquery()
        cols = [func.coalesce(ev.c[f"objects_{e}"], 0).label(f"objects_{e}") for e in EXACTNESS_NAMES]
        stmt = stmt.add_columns(*cols).outerjoin(ev, ev.c.run_id == Run.id)
    rows = _all(ledger, stmt)
    for r in rows:
        r["status"] = reported_status(r["status"])
    return rows


def tag_mix(ledger: Ledger, f: RunFilter) -> list[dict[str, Any]]:
    """Objects per run, tag and exactness over the runs (and request classes) of ``f``."""
    return _all(ledger, _tag_mix(f).order_by("run_id", "tag"))


def _tag_mix(f: RunFilter) -> Select[Any]:
    # grouped by (run_id, tag) only, the order of ix_events_run_tag: no temporary B-tree on 1M events;
    # a tag's exactness is fixed, so max() just carries it along
    # counted resident uses (step_requests) join the events as objects of their tag
    ids = _run_ids(f).scalar_subquery()
    u = object_uses(
        EventRow.run_id.in_(ids) & _in_classes(f, EventRow.run_id, EventRow.request_id),
        StepRequest.run_id.in_(ids) & _in_classes(f, StepRequest.run_id, StepRequest.request_id),
    )
    return select(
        u.c.run_id, u.c.tag, func.max(u.c.exactness).label("exactness"), func.sum(u.c.count).label("objects")
    ).group_by(u.c.run_id, u.c.tag)


def _p99_by_run(f: RunFilter) -> Any:
    """Subquery: p99 KL per run over its positions (linear interpolation, as numpy's default)."""
    pd = PositionDiffRow
    ranked = (
        select(
            pd.run_id,
            pd.kl,
            (func.row_number().over(partition_by=pd.run_id, order_by=pd.kl) - 1).label("rank"),
            func.count().over(partition_by=pd.run_id).label("n"),
        )
        .where(pd.run_id.in_(_run_ids(f).scalar_subquery()), _in_classes(f, pd.run_id, pd.request_id))
        .subquery()
    )
    lo = (ranked.c.n - 1) * 99 // 100  # floor((n - 1) * 0.99)
    frac = (ranked.c.n - 1) * 0.99 - lo
    return (
        select(
            ranked.c.run_id,
            func.sum(
                case(
                    (ranked.c.rank == lo, ranked.c.kl * (1.0 - frac)),
                    (ranked.c.rank == lo + 1, ranked.c.kl * frac),
                    else_=0.0,
                )
            )
            .cast(Float)
            .label("p99_kl"),
        )
        .group_by(ranked.c.run_id)
        .subquery()
    )


def drift_series(ledger: Ledger, f: RunFilter, limit: int = 500) -> list[dict[str, Any]]:
    """Per run (oldest first) over its audited positions: mean KL, p99 KL (linear interpolation, as
    numpy's default percentile), top-1 agreement, mean log(PPL ratio) = mean(logp_exact - logp_engine),
    plus the run's numeric floor, policy, model and newest run-level verdict."""
    pd = PositionDiffRow
    p99 = _p99_by_run(f)
    stats = (
        select(
            pd.run_id,
            func.count(func.distinct(pd.request_id)).label("audited_requests"),
            func.count().label("positions"),
            func.avg(pd.kl).label("mean_kl"),
            func.max(pd.kl).label("max_kl"),
            _float(func.avg(case((pd.top1_agree, 1.0), else_=0.0))).label("top1_agreement"),
            func.avg(pd.logp_exact - pd.logp_engine).label("mean_log_ppl_ratio"),
        )
        .where(pd.run_id.in_(_run_ids(f).scalar_subquery()), _in_classes(f, pd.run_id, pd.request_id))
        .group_by(pd.run_id)
        .subquery()
    )
    vd = _run_verdicts()
    stmt = (
        select(
            Run.id.label("run_id"),
            Run.started_at,
            POLICY_LABEL.label("policy"),
            Run.controller.label("controller"),
            Run.model_path.label("model"),
            Run.numeric_floor_kl,
            case((vd.c.passed.is_(None), None), (vd.c.passed, "pass"), else_="fail").label("verdict"),
            *[c for c in stats.c if c.name != "run_id"],
            p99.c.p99_kl,
        )
        .join(stats, stats.c.run_id == Run.id)
        .join(p99, p99.c.run_id == Run.id)
        .outerjoin(vd, vd.c.run_id == Run.id)
        .order_by(Run.started_at.desc(), Run.id.desc())
        .limit(limit)
    )
    return list(reversed(_all(ledger, stmt)))


def calibration_summary(ledger: Ledger, f: RunFilter) -> list[dict[str, Any]]:
    """Per tag and layer over the runs of ``f``: predicted cost (approximate events of a request's
    step) against the measured KL of the position that step produced — pairs, means and sums."""
    pd = PositionDiffRow
    # one measured KL per (run, request, step); grouped, so the database materialises it and looks
    # events up through ix_events_run_request_step instead of scanning positions per event
    measured = (
        select(pd.run_id, pd.request_id, pd.step_id, func.max(pd.kl).label("kl"))
        .where(
            pd.step_id.is_not(None),
            pd.run_id.in_(_run_ids(f).scalar_subquery()),
            _in_classes(f, pd.run_id, pd.request_id),
        )
        .group_by(pd.run_id, pd.request_id, pd.step_id)
        .subquery()
    )
    pairs = (
        select(
            EventRow.tag,
            EventRow.layer,
            func.sum(EventRow.predicted_cost).label("predicted"),
            func.max(measured.c.kl).label("kl"),
        )
        .join(
            EventRow,
            (EventRow.run_id == measured.c.run_id)
            & (EventRow.request_id == measured.c.request_id)
            & (EventRow.step_id == measured.c.step_id),
        )
        .where(EventRow.exactness == Exactness.APPROXIMATE.value)
        .group_by(measured.c.run_id, measured.c.request_id, measured.c.step_id, EventRow.tag, EventRow.layer)
        .subquery()
    )
    stmt = (
        select(
            pairs.c.tag,
            pairs.c.layer,
            func.count().label("pairs"),
            func.avg(pairs.c.predicted).label("mean_predicted"),
            func.avg(pairs.c.kl).label("mean_measured_kl"),
            func.sum(pairs.c.predicted).label("sum_predicted"),
            func.sum(pairs.c.kl).label("sum_measured_kl"),
        )
        .group_by(pairs.c.tag, pairs.c.layer)
        .order_by(pairs.c.tag, pairs.c.layer)
    )
    return _all(ledger, stmt)


def latest_calibrations(ledger: Ledger) -> list[dict[str, Any]]:
    """The newest fitted scale per tag and layer from ``calibrations``."""
    newest = select(func.max(Calibration.id)).group_by(Calibration.tag, Calibration.layer)
    stmt = (
        select(Calibration.tag, Calibration.layer, Calibration.scale, Calibration.num_samples, Calibration.fitted_at)
        .where(Calibration.id.in_(newest))
        .order_by(Calibration.tag, Calibration.layer)
    )
    return _all(ledger, stmt)

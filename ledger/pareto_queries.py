"""The Pareto page's query: measured TPOT against audited KL per run and request class."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select

from fallbackgate.ledger.dashboard_queries import POLICY_LABEL, RunFilter, _run_ids
from fallbackgate.ledger.db import Ledger
from fallbackgate.ledger.models import Request, RequestStatRow, Run
from fallbackgate.ledger.queries import _all


def pareto_points(ledger: Ledger, f: RunFilter) -> list[dict[str, Any]]:
    """Per run × request class: mean measured TPOT and TTFT, mean and worst audited mean KL, request counts,
    the policy label and the class's SLO and budget (from one of its requests)."""
    stats = RequestStatRow
    on = (stats.run_id == Request.run_id) & (stats.request_id == Request.request_id)
    stmt = (
        select(
            Request.run_id,
            Request.request_class,
            POLICY_LABEL.label("policy"),
            func.avg(Request.tpot_s).label("tpot_s"),
            func.avg(Request.ttft_s).label("ttft_s"),
            func.avg(stats.mean_kl).label("mean_kl"),
            func.max(stats.mean_kl).label("worst_mean_kl"),
            func.count().label("requests"),
            func.count(stats.mean_kl).label("audited"),
            func.max(Request.id).label("last_request"),
        )
        .join(Run, Run.id == Request.run_id)
        .outerjoin(stats, on)
        .where(Request.run_id.in_(_run_ids(f)))
        .group_by(Request.run_id, Request.request_class, POLICY_LABEL)
        .order_by(Request.run_id, Request.request_class)
    )
    if f.request_classes:
        stmt = stmt.where(Request.request_class.in_(f.request_classes))
    rows = _all(ledger, stmt)
    if rows:
        specs = _all(
            ledger,
            select(Request.id, Request.slo, Request.budget).where(Request.id.in_([r["last_request"] for r in rows])),
        )
        by_id = {s["id"]: s for s in specs}
        for r in rows:
            spec = by_id[r.pop("last_request")]
            r["tpot_slo_ms"] = (spec["slo"] or {}).get("tpot_ms")
            r["budget_mean_kl"] = (spec["budget"] or {}).get("max_mean_kl")
    return rows

"""The ``trace_analyses`` table: storing what ``fallbackgate trace analyze`` found, and reading it back for the
dashboard and the report. Rows are plain dicts (the analyses live above the ledger)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import delete, func, insert, select

from fallbackgate.ledger.db import Ledger, LedgerError, begin_write
from fallbackgate.ledger.models import Run, TraceAnalysisRow

FIELDS = ("analysis", "metric", "device", "value", "ci_low", "ci_high", "unit", "params")


def _number(value: Any) -> float | None:
    return None if value is None or (isinstance(value, float) and not math.isfinite(value)) else float(value)


def store_trace_analyses(
    ledger: Ledger, trace_path: str, workload: str, rows: Iterable[Mapping[str, Any]], run_id: int | None = None
) -> int:
    """Replace the rows of ``trace_path`` with ``rows`` (keys of :data:`FIELDS`); returns how many were stored.
    Non-finite values are stored as NULL. Raises LedgerError when ``run_id`` names no run."""
    values = []
    for row in rows:
        values.append({
            "run_id": run_id, "trace_path": trace_path, "workload": workload, "analysis": str(row["analysis"]),
            "metric": str(row["metric"]), "device": str(row.get("device") or ""), "value": _number(row["value"]),
            "ci_low": _number(row.get("ci_low")), "ci_high": _number(row.get("ci_high")),
            "unit": str(row.get("unit") or ""), "params": dict(row.get("params") or {}),
        })  # fmt: skip
    with begin_write(ledger.engine) as conn:
        if run_id is not None and conn.execute(select(Run.id).where(Run.id == run_id)).first() is None:
            raise LedgerError(f"ledger {ledger.display_url} has no run {run_id}")
        conn.execute(delete(TraceAnalysisRow).where(TraceAnalysisRow.trace_path == trace_path))
        if values:
            conn.execute(insert(TraceAnalysisRow), values)
    return len(values)


def analysed_traces(ledger: Ledger) -> list[dict[str, Any]]:
    """One row per analysed trace: trace_path, workload, run_id, num_rows, analysed_at (newest first)."""
    t = TraceAnalysisRow
    query = (
        select(t.trace_path, func.max(t.workload), func.max(t.run_id), func.count(), func.max(t.created_at))
        .group_by(t.trace_path)
        .order_by(func.max(t.created_at).desc(), t.trace_path)
    )
    with ledger.engine.connect() as conn:
        rows = conn.execute(query).all()
    keys = ("trace_path", "workload", "run_id", "num_rows", "analysed_at")
    return [dict(zip(keys, row, strict=True)) for row in rows]


def trace_analyses(ledger: Ledger, trace_paths: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """Every stored row (of ``trace_paths`` only, when given), in insertion order."""
    t = TraceAnalysisRow
    query = select(t.trace_path, t.workload, t.run_id, *(getattr(t, f) for f in FIELDS)).order_by(t.id)
    if trace_paths is not None:
        query = query.where(t.trace_path.in_(list(trace_paths)))
    with ledger.engine.connect() as conn:
        rows = conn.execute(query).all()
    keys = ("trace_path", "workload", "run_id", *FIELDS)
    return [dict(zip(keys, row, strict=True)) for row in rows]

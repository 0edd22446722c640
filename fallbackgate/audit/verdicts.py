"""Writing the gate's verdicts: through a run's ledger writer, or inside an audit worker's transaction."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, insert, update

from fallbackgate.audit.gate import RequestVerdict, RunVerdict
from fallbackgate.ledger.arbitration_queries import fill_audited_costs
from fallbackgate.ledger.audit_rows import verdict_row
from fallbackgate.ledger.models import Request, VerdictRow
from fallbackgate.ledger.writer import LedgerWriter


def _located(v: RequestVerdict) -> dict[str, Any]:
    """Where a request's verdict locates its failure, and its two halves, as verdict-row keywords."""
    return {
        "position": v.position,
        "step": v.step,
        "layer": v.layer,
        "tags": v.tags,
        "quality_passed": v.quality_passed,
        "correctness_passed": v.correctness_passed,
    }


def record_verdicts(writer: LedgerWriter, verdict: RunVerdict) -> None:
    """Write every request's verdict and the run's verdict into the ledger (queued on `writer`), and each
    arbitration's audited cost (the diffs are written by now)."""
    writer.fill_arbitration_costs(run_id=verdict.run_id)
    for v in verdict.requests:
        writer.record_verdict(v.request_id, v.passed, v.reason, **_located(v), run_id=verdict.run_id)
    writer.record_verdict(None, verdict.passed, "; ".join(verdict.reasons) or "ok", run_id=verdict.run_id)


def write_verdicts(conn: Connection, verdict: RunVerdict) -> None:
    """Insert every request's verdict and the run's, and mark each request pass/fail, inside `conn`'s
    transaction (what an audit worker commits together with its task), and each arbitration's audited cost."""
    fill_audited_costs(conn, verdict.run_id)
    rows = [verdict_row(verdict.run_id, v.request_id, v.passed, v.reason, **_located(v)) for v in verdict.requests]
    rows.append(verdict_row(verdict.run_id, None, verdict.passed, "; ".join(verdict.reasons) or "ok"))
    conn.execute(insert(VerdictRow.__table__), rows)
    table = Request.__table__
    for v in verdict.requests:
        conn.execute(
            update(table)
            .where(table.c.run_id == verdict.run_id, table.c.request_id == v.request_id)
            .values(verdict="pass" if v.passed else "fail")
        )

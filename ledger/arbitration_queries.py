"""The arbitrations table: reading a run's decisions back, and the audit's measured cost filled in."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, and_, select, update

from fallbackgate.ledger.db import Ledger
from fallbackgate.ledger.models import ArbitrationRow, PositionDiffRow


def run_arbitrations(ledger: Ledger, run_id: int) -> list[dict[str, Any]]:
    """Every arbitration of `run_id`, in step order, as column -> value."""
    table = ArbitrationRow.__table__
    stmt = select(table).where(table.c.run_id == run_id).order_by(table.c.step_id, table.c.id)
    with ledger.engine.connect() as conn:
        return [dict(row._mapping) for row in conn.execute(stmt)]


def fill_audited_costs(conn: Connection, run_id: int) -> int:
    """Set each arbitration's ``audited_cost`` to the KL the audit measured at the position its step sampled
    for its request (left NULL where that request was not audited or the step sampled nothing for it);
    returns the number of rows filled."""
    arb, diff = ArbitrationRow.__table__, PositionDiffRow.__table__
    measured = (
        select(diff.c.kl)
        .where(and_(diff.c.run_id == arb.c.run_id, diff.c.request_id == arb.c.request_id))
        .where(diff.c.step_id == arb.c.step_id)
        .limit(1)
        .scalar_subquery()
    )
    stmt = update(arb).where(arb.c.run_id == run_id).values(audited_cost=measured)
    conn.execute(stmt)
    count = select(arb.c.id).where(arb.c.run_id == run_id, arb.c.audited_cost.is_not(None))
    return len(conn.execute(count).all())

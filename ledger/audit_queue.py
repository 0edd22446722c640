"""The deferred audit queue: tasks claimed under a lease, results written only under a live fencing token.

A run served with deferred audits leaves one task per audited request (with its served logits) and one
run task (``RUN_TASK``: the floor control and the verdicts), claimable once every request task is done.
Workers claim with ``SELECT … FOR UPDATE SKIP LOCKED`` on PostgreSQL, so any number of them, on any number
of machines, share one ledger without claiming a task twice; SQLite serialises writers, so it takes one
worker. A claim bumps the task's fencing token and sets a lease; a worker that dies stops renewing it and,
once it expires, the next claim takes the task over. A result is written in the same transaction that
checks the claimant still holds the current token, so a slow first worker cannot write a second verdict.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable, Sequence

import numpy as np
import torch
from sqlalchemy import Connection, and_, exists, func, insert, or_, select, update
from sqlalchemy.orm import aliased

from fallbackgate.ledger.db import Ledger, begin_write
from fallbackgate.ledger.models import AuditTask, ServedLogitsRow, utcnow

RUN_TASK = "*run*"  # the run's own task: floor control and verdicts, after all its request tasks


class LeaseLost(RuntimeError):
    """The task was claimed by another worker after this worker's lease expired."""


@dataclasses.dataclass(frozen=True, slots=True)
class Claim:
    """A task this worker holds."""

    run_id: int
    request_id: str  # RUN_TASK for the run's own task
    token: int  # fencing token of this claim
    worker: str


def add_tasks(conn: Connection, run_id: int, request_ids: Sequence[str], with_run_task: bool = True) -> None:
    """Queue one task per request and (unless the run goes on serving) the run's own task, inside the
    caller's transaction."""
    ids = [*request_ids, RUN_TASK] if with_run_task else list(request_ids)
    rows = [
        {"run_id": run_id, "request_id": rid, "state": "pending", "fencing_token": 0, "num_attempts": 0} for rid in ids
    ]
    if rows:
        conn.execute(insert(AuditTask.__table__), rows)


def served_rows(run_id: int, request_id: str, logits: torch.Tensor) -> list[dict[str, object]]:
    """served_logits rows of one request ([positions, vocab] logits stored as float32 bytes)."""
    array = logits.detach().to("cpu", torch.float32).numpy().astype("<f4", copy=False)
    return [
        {"run_id": run_id, "request_id": request_id, "position": i, "logits": array[i].tobytes()}
        for i in range(array.shape[0])
    ]


def read_served(ledger: Ledger, run_id: int, request_id: str) -> Callable[[int, int], torch.Tensor]:
    """Served logits of output positions [start, stop), read from the ledger chunk by chunk."""
    table = ServedLogitsRow.__table__

    def rows(start: int, stop: int) -> torch.Tensor:
        stmt = (
            select(table.c.position, table.c.logits)
            .where(
                table.c.run_id == run_id,
                table.c.request_id == request_id,
                table.c.position >= start,
                table.c.position < stop,
            )
            .order_by(table.c.position)
        )
        with ledger.engine.connect() as conn:
            found = conn.execute(stmt).all()
        if [r.position for r in found] != list(range(start, stop)):
            raise LookupError(f"request {request_id}: served logits of positions {start}..{stop - 1} are missing")
        return torch.from_numpy(np.stack([np.frombuffer(r.logits, dtype="<f4") for r in found]).copy())

    return rows


def _claimable(now: dt.datetime, run_id: int | None):  # noqa: ANN202 - a SQLAlchemy clause
    other = aliased(AuditTask)
    unfinished_requests = exists().where(
        other.run_id == AuditTask.run_id, other.request_id != RUN_TASK, other.state != "done"
    )
    clause = and_(
        or_(AuditTask.state == "pending", and_(AuditTask.state == "claimed", AuditTask.lease_expires_at < now)),
        or_(AuditTask.request_id != RUN_TASK, ~unfinished_requests),
    )
    return clause if run_id is None else and_(clause, AuditTask.run_id == run_id)


def claim(ledger: Ledger, worker: str, lease_s: float, run_id: int | None = None) -> Claim | None:
    """Claim the next claimable task (pending, or claimed under an expired lease), or None."""
    now = utcnow()
    stmt = select(AuditTask.run_id, AuditTask.request_id).where(_claimable(now, run_id))
    stmt = stmt.order_by(AuditTask.run_id, AuditTask.request_id).limit(1)
    if not ledger.is_sqlite:
        stmt = stmt.with_for_update(skip_locked=True, of=AuditTask)
    with begin_write(ledger.engine) as conn:
        row = conn.execute(stmt).first()
        if row is None:
            return None
        token = conn.execute(
            update(AuditTask)
            .where(AuditTask.run_id == row.run_id, AuditTask.request_id == row.request_id)
            .values(
                state="claimed",
                fencing_token=AuditTask.fencing_token + 1,
                lease_expires_at=now + dt.timedelta(seconds=lease_s),
                worker=worker,
                num_attempts=AuditTask.num_attempts + 1,
            )
            .returning(AuditTask.fencing_token)
        ).scalar_one()
    return Claim(row.run_id, row.request_id, int(token), worker)


def check_held(conn: Connection, held: Claim) -> None:
    """Raise LeaseLost unless `held` is still the task's current claim (locks the task row until commit)."""
    stmt = select(AuditTask.fencing_token, AuditTask.state).where(
        AuditTask.run_id == held.run_id, AuditTask.request_id == held.request_id
    )
    if conn.dialect.name != "sqlite":
        stmt = stmt.with_for_update()
    row = conn.execute(stmt).first()
    if row is None or row.fencing_token != held.token or row.state != "claimed":
        current = "gone" if row is None else f"{row.state} under token {row.fencing_token}"
        raise LeaseLost(
            f"task {held.run_id}/{held.request_id}: this worker's token {held.token} is stale ({current}); "
            "its result is discarded"
        )


def renew(ledger: Ledger, held: Claim, lease_s: float) -> None:
    """Extend the lease of a task still held (LeaseLost when another worker took it over)."""
    with begin_write(ledger.engine) as conn:
        check_held(conn, held)
        conn.execute(
            update(AuditTask)
            .where(AuditTask.run_id == held.run_id, AuditTask.request_id == held.request_id)
            .values(lease_expires_at=utcnow() + dt.timedelta(seconds=lease_s))
        )


def complete(ledger: Ledger, held: Claim, write: Callable[[Connection], None]) -> None:
    """Run `write` and mark the task done in one transaction, if and only if `held` is still current."""
    with begin_write(ledger.engine) as conn:
        check_held(conn, held)
        write(conn)
        conn.execute(
            update(AuditTask)
            .where(AuditTask.run_id == held.run_id, AuditTask.request_id == held.request_id)
            .values(state="done", done_at=utcnow(), lease_expires_at=None)
        )


def task_counts(ledger: Ledger, run_id: int | None = None) -> dict[str, int]:
    """Tasks per state (over every run, or one)."""
    stmt = select(AuditTask.state, func.count()).group_by(AuditTask.state)
    if run_id is not None:
        stmt = stmt.where(AuditTask.run_id == run_id)
    with ledger.engine.connect() as conn:
        return {state: int(n) for state, n in conn.execute(stmt).all()}

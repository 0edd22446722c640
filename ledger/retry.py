"""Riding out a ledger that goes away: which errors are worth retrying, backoff, and whether a transaction
whose COMMIT was cut off did commit.

A PostgreSQL server restarted or unreachable fails statements with ``OperationalError`` (connection refused,
"terminating connection due to administrator command") or invalidates the connection; such a failure is
transient, and the transaction did not commit — unless it was cut off during COMMIT itself. For that one
case the writer asks for the transaction's id before writing (``txid_current()``) and, once the server is
back, its fate (``txid_status()``, PostgreSQL 10+: "committed", "aborted" or "in progress"; a transaction
still in progress has its lost session ended first), so a batch is written exactly once. SQLite ledgers are
local files: their errors are never treated as transient.
"""

from __future__ import annotations

import dataclasses
import time

from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

DEFAULT_RETRY_S = 120.0  # how long a ledger may stay away before writes fail for good
FIRST_DELAY_S = 0.1  # the first wait after a failure
MAX_DELAY_S = 2.0  # waits double up to this


def is_transient(exc: BaseException, dialect_name: str) -> bool:
    """True for a lost or refused connection to a database server (never for SQLite)."""
    if dialect_name == "sqlite":
        return False
    if isinstance(exc, OperationalError | InterfaceError):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


@dataclasses.dataclass(slots=True)
class Backoff:
    """Exponential waits between attempts, and the window after which retrying stops."""

    retry_s: float = DEFAULT_RETRY_S  # give up once the first failure is this old
    first_failure: float | None = None  # monotonic time of the first failure of the current outage
    delay_s: float = FIRST_DELAY_S  # the next wait
    num_retries: int = 0  # attempts made after a failure, over this object's life

    def failed(self) -> float:
        """Note a failure; returns the seconds to wait before the next attempt (``inf``: give up)."""
        now = time.monotonic()
        if self.first_failure is None:
            self.first_failure = now
        if now - self.first_failure >= self.retry_s:
            return float("inf")
        wait, self.delay_s = self.delay_s, min(MAX_DELAY_S, self.delay_s * 2)
        self.num_retries += 1
        return wait

    def succeeded(self) -> None:
        """The ledger answered: the outage (if any) is over."""
        self.first_failure, self.delay_s = None, FIRST_DELAY_S

    @property
    def outage_s(self) -> float:
        """Seconds since the current outage's first failure (0.0 when the ledger answers)."""
        return 0.0 if self.first_failure is None else time.monotonic() - self.first_failure


@dataclasses.dataclass(frozen=True, slots=True)
class Transaction:
    """A PostgreSQL transaction whose fate may have to be asked about later."""

    xid: int  # its transaction id (txid_current())
    backend_pid: int  # the server process of its session (pg_backend_pid())


def transaction_id(conn: Connection) -> Transaction | None:
    """``conn``'s transaction (its id assigned now) on PostgreSQL; None elsewhere."""
    if conn.dialect.name != "postgresql":
        return None
    row = conn.execute(text("SELECT txid_current(), pg_backend_pid()")).one()
    return Transaction(int(row[0]), int(row[1]))


def transaction_status(engine: Engine, txn: Transaction) -> str:
    """What became of ``txn``: "committed", "aborted" or "in progress" (PostgreSQL's ``txid_status``; a
    transaction the server lost in a crash reads "aborted"). One still in progress belongs to a session the
    client lost (a partition: the server has not noticed): that session is ended, so the next ask settles it."""
    with engine.connect() as conn:
        status = conn.execute(text("SELECT txid_status(:xid)"), {"xid": txn.xid}).scalar_one()
        if status == "in progress":
            conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": txn.backend_pid})
            conn.commit()
    return str(status) if status is not None else "aborted"

"""The ledger's declarative base and what its tables share: run statuses, the UTC clock, the run foreign key.

Every table is declared on :class:`Base` in one of the ``models_*`` modules; :mod:`fallbackgate.ledger.models`
imports them all, so ``Base.metadata`` (which the migrations and ``create_all`` see) holds every table once it
is imported.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import ForeignKey
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

RUN_STATUSES: tuple[str, ...] = ("running", "complete", "failed", "incomplete", "interrupted")
"""Stored run statuses. A run whose process died stays "running"; queries report it "incomplete". A run
stopped by SIGINT or SIGTERM is "interrupted" (what it recorded until then is flushed)."""


def utcnow() -> dt.datetime:
    """Current time, timezone-aware UTC."""
    return dt.datetime.now(dt.UTC)


class Base(DeclarativeBase):
    """Declarative base of all ledger tables."""


def run_fk() -> Mapped[int]:
    """A non-null ``run_id`` column referencing ``runs.id``, deleted with its run."""
    return mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), nullable=False)

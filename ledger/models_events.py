"""Ledger tables of what serving did: fallback events and the objects they covered, dual-miss arbitrations, KV copy
changes and quarantined objects."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    Index,
    Integer,
    String,
    Text,
)
from sqlalchemy.orm import Mapped, mapped_column

from fallbackgate.ledger.models_base import Base, run_fk, utcnow


class EventRow(Base):
    """One event: step × request × layer × object kind × tag, with counts, bytes and costs."""

    __tablename__ = "events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    # No foreign key on the bulk table: a per-row check (a trigger per row on PostgreSQL) halves the
    # insert rate. Only LedgerWriter writes events, for run ids it created; delete_run() cleans up.
    run_id: Mapped[int] = mapped_column(Integer, nullable=False)
    step_id: Mapped[int] = mapped_column(Integer)
    request_id: Mapped[str] = mapped_column(String(128))
    layer: Mapped[int] = mapped_column(Integer)
    object_kind: Mapped[str] = mapped_column(String(16))
    tag: Mapped[str] = mapped_column(String(32))
    exactness: Mapped[str] = mapped_column(String(16))
    count: Mapped[int] = mapped_column(Integer)
    bytes_moved: Mapped[int] = mapped_column(BigInteger, default=0)
    source_tier: Mapped[str | None] = mapped_column(String(16))
    predicted_cost: Mapped[float] = mapped_column(Float, default=0.0)
    modeled_s: Mapped[float] = mapped_column(Float, default=0.0)
    note: Mapped[str] = mapped_column(Text, default="")
    __table_args__ = (
        Index("ix_events_run_tag", "run_id", "tag"),
        Index("ix_events_run_request_step", "run_id", "request_id", "step_id"),
    )


class EventObjectsRow(Base):
    """Which objects an approximate or rebuild event covered, at what precision, in which pass: what the
    replay baseline repeats. Kept beside the events (most events name no objects) so the bulk table stays
    narrow."""

    __tablename__ = "event_objects"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = mapped_column(Integer, nullable=False)  # no foreign key, as for events
    step_id: Mapped[int] = mapped_column(Integer)
    request_id: Mapped[str] = mapped_column(String(128))
    layer: Mapped[int] = mapped_column(Integer)
    object_kind: Mapped[str] = mapped_column(String(16))
    tag: Mapped[str] = mapped_column(String(32))
    bits: Mapped[int] = mapped_column(Integer)  # precision of a low-bit copy (expert_lowbit, kv_dequant); 0 otherwise
    is_rebuild: Mapped[bool] = mapped_column(Boolean)  # done in a KV rebuild pass before the step's own forward
    object_ids: Mapped[str] = mapped_column(Text)  # "3,7": expert ids or KV block indices
    __table_args__ = (Index("ix_event_objects_run_request", "run_id", "request_id", "step_id"),)


class ArbitrationRow(Base):
    """One dual-miss arbitration: what was late in a step, the options with their predicted time and quality
    cost, the controller's choice, its predicted and measured arrival against the step's deadline, and the
    quality cost the audit measured afterwards."""

    __tablename__ = "arbitrations"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = run_fk()
    step_id: Mapped[int] = mapped_column(Integer)
    request_id: Mapped[str] = mapped_column(String(128))  # the request whose object was late
    layer: Mapped[int] = mapped_column(Integer)
    object_kind: Mapped[str] = mapped_column(String(16))  # kv_block or expert
    object_id: Mapped[int] = mapped_column(Integer)  # KV block index in the request's table, or expert id
    late: Mapped[str] = mapped_column(Text)  # what was late: its predicted link time against the time left
    options: Mapped[list[dict[str, Any]]] = mapped_column(JSON)  # [{tag, predicted_s, predicted_cost,
    # is_feasible, note}]: every option weighed
    choice: Mapped[str] = mapped_column(String(32))  # the tag served
    reason: Mapped[str] = mapped_column(Text)  # the controller's reason
    predicted_cost: Mapped[float] = mapped_column(Float)  # predicted nats of the choice
    deadline_s: Mapped[float] = mapped_column(Float)  # the step's link time, seconds from its start
    predicted_arrival_s: Mapped[float] = mapped_column(Float)  # when the choice was predicted usable
    measured_arrival_s: Mapped[float | None] = mapped_column(Float)  # when it was usable (None: not staged)
    stall_s: Mapped[float | None] = mapped_column(Float)  # measured arrival past the deadline (0: in time)
    audited_cost: Mapped[float | None] = mapped_column(Float)  # KL the audit measured at the position the step
    # sampled for the request (None until audited; shared with the step's other actions for that request)
    __table_args__ = (Index("ix_arbitrations_run_step", "run_id", "step_id"),)


class KVCopyRow(Base):
    """Consecutive changes of one kind to copies of one request's KV blocks of one layer in one tier and
    precision (the engine's ``KVCopyChange``): written, read to serve a step, or freed."""

    __tablename__ = "kv_copies"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = run_fk()
    step_id: Mapped[int] = mapped_column(Integer)  # step whose result carried the changes
    seq: Mapped[int] = mapped_column(BigInteger)  # ordinal of the first change in the run (block i: seq + i)
    request_id: Mapped[str] = mapped_column(String(128))
    layer: Mapped[int] = mapped_column(Integer)
    action: Mapped[str] = mapped_column(String(16))  # written, read or freed
    tier: Mapped[str] = mapped_column(String(16))  # host or disk
    bits: Mapped[int] = mapped_column(Integer)  # 0: full precision; 8 or 4: a quantized copy
    block_ids: Mapped[str] = mapped_column(Text)  # "3,4": block indices, in change order
    num_bytes: Mapped[int] = mapped_column(BigInteger)  # bytes written or read (0 for frees)
    # quantized copies written: "hex,hex" xxh3-64 of each block's codes, as block_ids (None otherwise)
    code_checksums: Mapped[str | None] = mapped_column(Text, nullable=True)
    __table_args__ = (Index("ix_kv_copies_run_request", "run_id", "request_id", "seq"),)


class QuarantineRow(Base):
    """A checkpoint object whose reads failed twice (``request_id`` NULL: the object itself, with its files,
    tensors, the manifest's hash and the one read), or one request it touched: ``effect`` "failed" (the request
    ended with an error), "deferred" (served with ``expert_defer`` instead) or "unaudited" (its audit needed it)."""

    __tablename__ = "quarantines"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = run_fk()
    request_id: Mapped[str | None] = mapped_column(String(128))
    object_kind: Mapped[str] = mapped_column(String(16))  # "expert" or "kv_block"
    object_id: Mapped[str] = mapped_column(String(64))  # "layer:expert", or the KV block's key
    effect: Mapped[str] = mapped_column(String(16))  # "quarantined", "failed", "deferred", "unaudited"
    detail: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    created_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), default=utcnow)
    __table_args__ = (Index("ix_quarantines_run_request", "run_id", "request_id"),)

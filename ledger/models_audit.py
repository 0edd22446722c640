"""Ledger tables of the audit: position diffs against the exact baseline, their per-request statistics, gate
verdicts, weight verifications, and the served logits and tasks left for audit workers."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
)
from sqlalchemy.orm import Mapped, mapped_column

from fallbackgate.ledger.models_base import Base, run_fk, utcnow


class PositionDiffRow(Base):
    """Diff statistics of one generated position against the exact baseline."""

    __tablename__ = "position_diffs"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    request_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    position: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    step_id: Mapped[int | None] = mapped_column(Integer)  # step that sampled this token, when known
    token_id: Mapped[int] = mapped_column(Integer)  # emitted token
    kl: Mapped[float] = mapped_column(Float)
    top1_agree: Mapped[bool] = mapped_column(Boolean)
    delta_p: Mapped[float] = mapped_column(Float)
    max_abs_dlogit: Mapped[float] = mapped_column(Float)
    vllm_top5_ok: Mapped[bool] = mapped_column(Boolean)
    logp_exact: Mapped[float] = mapped_column(Float)
    logp_engine: Mapped[float] = mapped_column(Float)
    exact_top2_gap: Mapped[float | None] = mapped_column(Float)  # exact top-1 minus top-2 logit: a near-tie if small
    replay_kl: Mapped[float | None] = mapped_column(Float)  # KL(replay ‖ served): nonzero beyond noise is a bug


class RequestStatRow(Base):
    """Per-request summary of the position diffs (llama.cpp --kl-divergence statistics)."""

    __tablename__ = "request_stats"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    request_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    num_positions: Mapped[int] = mapped_column(Integer)
    mean_kl: Mapped[float] = mapped_column(Float)
    median_kl: Mapped[float] = mapped_column(Float)
    p99_kl: Mapped[float] = mapped_column(Float)
    max_kl: Mapped[float] = mapped_column(Float)
    sem_kl: Mapped[float] = mapped_column(Float)
    top1_agreement: Mapped[float] = mapped_column(Float)
    rms_delta_p: Mapped[float] = mapped_column(Float)
    ppl_ratio: Mapped[float] = mapped_column(Float)
    first_divergence: Mapped[int | None] = mapped_column(Integer)  # first top-1 disagreement position
    replay_max_kl: Mapped[float | None] = mapped_column(Float)  # served vs its replay: correctness, not cost
    replay_mean_kl: Mapped[float | None] = mapped_column(Float)
    replay_max_position: Mapped[int | None] = mapped_column(Integer)  # output position of replay_max_kl
    replay_top1_agreement: Mapped[float | None] = mapped_column(Float)
    replay_error: Mapped[str | None] = mapped_column(Text)  # why the replay could not follow the trace
    replay_routing_swaps: Mapped[int | None] = mapped_column(Integer)  # tokens the replay routed as served
    # across a router near-tie (audit.routing_ties)


class VerdictRow(Base):
    """A gate verdict for one request, or for the whole run when ``request_id`` is NULL."""

    __tablename__ = "verdicts"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = run_fk()
    request_id: Mapped[str | None] = mapped_column(String(128))
    passed: Mapped[bool] = mapped_column(Boolean)
    reason: Mapped[str] = mapped_column(Text, default="")
    first_divergence_position: Mapped[int | None] = mapped_column(Integer)
    first_divergence_step: Mapped[int | None] = mapped_column(Integer)
    first_divergence_layer: Mapped[int | None] = mapped_column(Integer)
    first_divergence_tags: Mapped[list[str] | None] = mapped_column(JSON(none_as_null=True))
    quality_passed: Mapped[bool | None] = mapped_column(Boolean)  # against the exact baseline and budget
    correctness_passed: Mapped[bool | None] = mapped_column(Boolean)  # against the replay (None: not replayed)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    __table_args__ = (Index("ix_verdicts_run_request", "run_id", "request_id"),)


class VerificationRow(Base):
    """An in-memory weight copy checked against the checkpoint (sampled expert copies, dense weights)."""

    __tablename__ = "verifications"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = run_fk()
    step_id: Mapped[int | None] = mapped_column(Integer)  # step after which it was checked (None: at audit)
    object_kind: Mapped[str] = mapped_column(String(16))  # "expert" or "dense"
    name: Mapped[str] = mapped_column(Text)  # "layer:expert" or the dense weight's name
    tier: Mapped[str | None] = mapped_column(String(16))  # where the copy lives
    passed: Mapped[bool] = mapped_column(Boolean)
    note: Mapped[str] = mapped_column(Text, default="")
    __table_args__ = (Index("ix_verifications_run", "run_id", "passed"),)


class ServedLogitsRow(Base):
    """The served logits of one output position of a request left for an audit worker (float32 bytes)."""

    __tablename__ = "served_logits"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    request_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    position: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    logits: Mapped[bytes] = mapped_column(LargeBinary)  # [vocab] float32, little-endian


class AuditTask(Base):
    """One unit of deferred audit work: a request, or (request_id RUN_TASK) the run's floor and verdict."""

    __tablename__ = "audit_tasks"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    request_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    state: Mapped[str] = mapped_column(String(16), default="pending")  # pending, claimed or done
    fencing_token: Mapped[int] = mapped_column(Integer, default=0)  # bumped by every claim
    lease_expires_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    worker: Mapped[str | None] = mapped_column(String(128))  # host:pid of the latest claimant
    num_attempts: Mapped[int] = mapped_column(Integer, default=0)
    done_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    __table_args__ = (Index("ix_audit_tasks_state", "state", "run_id"),)

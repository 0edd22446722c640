"""Ledger tables of a run itself: the run, its requests, its steps and what each step did for each request."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
)
from sqlalchemy.orm import Mapped, mapped_column

from fallbackgate.ledger.models_base import Base, run_fk, utcnow


class Run(Base):
    """One engine run: its policy, model, hardware profile and outcome."""

    __tablename__ = "runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    started_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    status: Mapped[str] = mapped_column(String(16), default="running")
    policy: Mapped[str | None] = mapped_column(Text)  # the effective policy (file plus overrides) as JSON
    policy_name: Mapped[str | None] = mapped_column(String(128))  # policy file stem, e.g. "balanced"
    model_path: Mapped[str | None] = mapped_column(Text)
    hardware_profile: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    versions: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    controller: Mapped[str | None] = mapped_column(String(64))
    mode: Mapped[str | None] = mapped_column(String(16))  # "observe" or "enforce"
    numeric_floor_kl: Mapped[float | None] = mapped_column(Float)  # max KL of the exact-vs-exact control
    memory: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))  # budgets, peaks, dense bytes
    numeric_floor: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))  # the control's stats
    note: Mapped[str | None] = mapped_column(Text)
    forced_tags: Mapped[list[str] | None] = mapped_column(JSON(none_as_null=True))  # tags --force turned on
    trace_path: Mapped[str | None] = mapped_column(Text)  # the run's trace directory (run --trace DIR)
    __table_args__ = (Index("ix_runs_started_at", "started_at"),)


class Request(Base):
    """One request of a run (finished, or cancelled at shutdown), with its SLO, quality budget, timings and
    verdict."""

    __tablename__ = "requests"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = run_fk()
    request_id: Mapped[str] = mapped_column(String(128))
    request_class: Mapped[str] = mapped_column(String(64), default="default")
    prompt: Mapped[str | None] = mapped_column(Text)
    num_prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    num_output_tokens: Mapped[int] = mapped_column(Integer, default=0)
    num_preemptions: Mapped[int] = mapped_column(Integer, default=0)
    # prompt positions whose KV it adopted from kept prefix blocks (prefill skipped)
    num_reused_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    slo: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    budget: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    ttft_s: Mapped[float | None] = mapped_column(Float)
    tpot_s: Mapped[float | None] = mapped_column(Float)
    modeled_ttft_s: Mapped[float | None] = mapped_column(Float)
    modeled_tpot_s: Mapped[float | None] = mapped_column(Float)
    verdict: Mapped[str | None] = mapped_column(String(16))  # "pass", "fail" or None before the gate
    tag_counts: Mapped[dict[str, int] | None] = mapped_column(JSON(none_as_null=True))
    token_ids: Mapped[list[int] | None] = mapped_column(JSON(none_as_null=True))  # prompt then output tokens
    status: Mapped[str | None] = mapped_column(String(16))  # "finished" or "cancelled" (None: before 0007)
    __table_args__ = (Index("ux_requests_run_request", "run_id", "request_id", unique=True),)


class Step(Base):
    """One engine step (forward pass) of a run."""

    __tablename__ = "steps"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    step_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    kind: Mapped[str] = mapped_column(String(16))
    num_requests: Mapped[int] = mapped_column(Integer, default=0)
    num_tokens: Mapped[int] = mapped_column(Integer, default=0)
    is_observe: Mapped[bool] = mapped_column(Boolean, default=False)
    wall_s: Mapped[float] = mapped_column(Float, default=0.0)
    modeled_s: Mapped[float] = mapped_column(Float, default=0.0)
    device_bytes_expert: Mapped[int] = mapped_column(BigInteger, default=0)
    device_bytes_kv: Mapped[int] = mapped_column(BigInteger, default=0)
    transfer_s: Mapped[float | None] = mapped_column(Float)  # measured expert disk-read seconds of the step
    transfer_exposed_s: Mapped[float | None] = mapped_column(Float)  # of which the compute thread waited for
    num_predicted_reads: Mapped[int | None] = mapped_column(Integer)  # next-layer read-ahead reads started
    num_predicted_used: Mapped[int | None] = mapped_column(Integer)  # needed reads a prediction had started
    num_unpredicted_reads: Mapped[int | None] = mapped_column(Integer)  # needed reads no prediction started
    num_events: Mapped[int | None] = mapped_column(Integer)  # event rows the engine produced for the step
    num_verified: Mapped[int | None] = mapped_column(Integer)  # copies checked after it (failures: verifications)
    num_resident_expert_uses: Mapped[int | None] = mapped_column(Integer)  # resident expert uses the engine counted
    # (no event rows; the sum of its step_requests' counts)
    num_resident_kv_reads: Mapped[int | None] = mapped_column(Integer)  # KV blocks read on device, engine-counted


class StepRequest(Base):
    """What one step did for one request: the positions it computed and the events it produced."""

    __tablename__ = "step_requests"
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    step_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    request_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    start_position: Mapped[int] = mapped_column(Integer)  # first position the step's own forward computed
    num_tokens: Mapped[int] = mapped_column(Integer)  # positions it computed (prefill chunk, or 1)
    is_sampled: Mapped[bool] = mapped_column(Boolean)  # the step sampled an output token for the request
    num_events: Mapped[int] = mapped_column(Integer)  # event rows the engine produced for the request
    num_objects: Mapped[int] = mapped_column(Integer)  # objects those events cover (sum of their counts)
    kv_resident_reads: Mapped[str | None] = mapped_column(Text)  # "3,3,2": KV blocks read on device, per layer
    rebuild_objects: Mapped[int | None] = mapped_column(Integer)  # expert objects its KV rebuild pass computed
    num_resident_expert_uses: Mapped[int | None] = mapped_column(Integer)  # experts used resident (not events)
    resident_expert_uses: Mapped[str | None] = mapped_column(Text)  # "8,8,0,8": those uses per layer from 0
    routing_digests: Mapped[str | None] = mapped_column(Text)  # a 64-bit digest of the experts its own forward
    # routed to, per layer from 0, in hex (rows.digests_text); the audit's replay checks its routing against them

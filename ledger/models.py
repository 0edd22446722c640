"""SQLAlchemy 2.x models of the ledger.

Enum-valued columns (``tag``, ``object_kind``, ``exactness``, ``source_tier``, ``kind``) hold the
``.value`` strings of the engine's enums (``fallbackgate.engine.tags``, ``fallbackgate.engine.messages``),
so the ledger reads without importing the engine. The schema itself is created by the Alembic migrations in
``ledger/migrations``; ``Base.metadata`` mirrors it and a test checks that they agree.
"""

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
    LargeBinary,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

RUN_STATUSES: tuple[str, ...] = ("running", "complete", "failed", "incomplete", "interrupted")
"""Stored run statuses. A run whose process died stays "running"; queries report it "incomplete". A run
stopped by SIGINT or SIGTERM is "interrupted" (what it recorded until then is flushed)."""


def utcnow() -> dt.datetime:
    """Current time, timezone-aware UTC."""
    return dt.datetime.now(dt.UTC)


class Base(DeclarativeBase):
    """Declarative base of all ledger tables."""


def _run_fk() -> Mapped[int]:
    return mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), nullable=False)


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
    run_id: Mapped[int] = _run_fk()
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


class VerdictRow(Base):
    """A gate verdict for one request, or for the whole run when ``request_id`` is NULL."""

    __tablename__ = "verdicts"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = _run_fk()
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
    run_id: Mapped[int] = _run_fk()
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


class Calibration(Base):
    """A fitted scale of the quality-cost predictor for one tag and layer."""

    __tablename__ = "calibrations"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tag: Mapped[str] = mapped_column(String(32))
    layer: Mapped[int] = mapped_column(Integer)
    scale: Mapped[float] = mapped_column(Float)
    fitted_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    num_samples: Mapped[int] = mapped_column(Integer, default=0)
    run_ids: Mapped[list[int] | None] = mapped_column(JSON(none_as_null=True))
    __table_args__ = (Index("ix_calibrations_tag_layer", "tag", "layer", "fitted_at"),)


class ArbitrationRow(Base):
    """One dual-miss arbitration: what was late in a step, the options with their predicted time and quality
    cost, the controller's choice, its predicted and measured arrival against the step's deadline, and the
    quality cost the audit measured afterwards."""

    __tablename__ = "arbitrations"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = _run_fk()
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
    run_id: Mapped[int] = _run_fk()
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


class TraceAnalysisRow(Base):
    """One number ``fallbackgate trace analyze`` found in a trace (co-burst, marginal value, flips, ...)."""

    __tablename__ = "trace_analyses"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))  # the recorded run, if any
    trace_path: Mapped[str] = mapped_column(Text)  # the trace directory analysed (absolute)
    workload: Mapped[str] = mapped_column(String(128))  # the trace's workload name
    analysis: Mapped[str] = mapped_column(String(32))  # co_burst, marginal_value, flips, dual_miss, ...
    metric: Mapped[str] = mapped_column(String(64))  # e.g. "lift", "num_flips"
    device: Mapped[str] = mapped_column(String(64), default="")  # the device model it was priced on
    value: Mapped[float | None] = mapped_column(Float)  # NULL: not computable on this trace
    ci_low: Mapped[float | None] = mapped_column(Float)  # 95 % interval, where the analysis gives one
    ci_high: Mapped[float | None] = mapped_column(Float)
    unit: Mapped[str] = mapped_column(String(32), default="")
    params: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))  # lag, window, phase, ...
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    __table_args__ = (Index("ix_trace_analyses_trace", "trace_path", "analysis"),)


class QuarantineRow(Base):
    """A checkpoint object whose reads failed twice (``request_id`` NULL: the object itself, with its files,
    tensors, the manifest's hash and the one read), or one request it touched: ``effect`` "failed" (the request
    ended with an error), "deferred" (served with ``expert_defer`` instead) or "unaudited" (its audit needed it)."""

    __tablename__ = "quarantines"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[int] = _run_fk()
    request_id: Mapped[str | None] = mapped_column(String(128))
    object_kind: Mapped[str] = mapped_column(String(16))  # "expert" or "kv_block"
    object_id: Mapped[str] = mapped_column(String(64))  # "layer:expert", or the KV block's key
    effect: Mapped[str] = mapped_column(String(16))  # "quarantined", "failed", "deferred", "unaudited"
    detail: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    created_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), default=utcnow)
    __table_args__ = (Index("ix_quarantines_run_request", "run_id", "request_id"),)

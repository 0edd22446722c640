"""Ledger tables of what was fitted or analysed afterwards: cost-predictor calibrations and trace analyses."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    JSON,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
)
from sqlalchemy.orm import Mapped, mapped_column

from fallbackgate.ledger.models_base import Base, utcnow


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

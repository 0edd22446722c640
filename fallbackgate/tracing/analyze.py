"""``fallbackgate trace analyze``: every analysis of one trace, its figures, and its rows for the ledger."""

from __future__ import annotations

import collections
import dataclasses
import re
from pathlib import Path
from typing import Any

from fallbackgate.ledger.db import Ledger
from fallbackgate.ledger.trace_queries import store_trace_analyses
from fallbackgate.tracing import budget, coburst, dual_miss, figures, prediction
from fallbackgate.tracing.devices import device_models
from fallbackgate.tracing.reader import Trace
from fallbackgate.tracing.results import AnalysisResult
from fallbackgate.tracing.timeline import build_timeline


@dataclasses.dataclass(slots=True)
class TraceAnalysis:
    """Everything ``trace analyze`` found in one trace."""

    trace: Trace  # the trace analysed
    results: list[AnalysisResult]  # one per analysis (devices' rows ride on flips and marginal value)
    device_names: list[str]  # the device models, measured first
    label: str = ""  # what a report calls it and its figures are named by ("": the trace's workload)

    @property
    def title(self) -> str:
        """The label, else the trace's workload."""
        return self.label or self.trace.workload

    def result(self, name: str) -> AnalysisResult:
        """The result of the analysis called ``name``."""
        return next(r for r in self.results if r.analysis.value == name)

    def ledger_rows(self) -> list[dict[str, Any]]:
        """Every row as the ledger stores it."""
        rows = []
        for result in self.results:
            for row in result.rows:
                rows.append({**dataclasses.asdict(row), "analysis": row.analysis.value})
        return rows


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "trace"


def trace_labels(traces: list[Trace]) -> list[str]:
    """One label per trace: its workload, with its directory's name where another trace has the same workload
    (two seeds of one sweep cell), numbered where even those agree, so no two sections or figure names of a
    report are the same."""
    counts = collections.Counter(t.workload for t in traces)
    labels = [t.workload if counts[t.workload] == 1 else f"{t.workload} ({t.path.name})" for t in traces]
    seen: collections.Counter[str] = collections.Counter()
    out = []
    for label in labels:  # same workload and directory name (two sweeps' kept cells): numbered
        seen[_slug(label)] += 1
        out.append(label if seen[_slug(label)] == 1 else f"{label} #{seen[_slug(label)]}")
    return out


def analyze_trace(trace: Trace, out_dir: Path, label: str = "") -> TraceAnalysis:
    """Run every analysis on ``trace`` and write its figures under ``out_dir``, named by ``label`` (default: the
    trace's workload)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    devices = device_models(trace)
    timeline = build_timeline(trace)
    title = label or trace.workload
    name = _slug(title)
    results = [
        coburst.co_burst(trace),
        budget.marginal_value(timeline, devices),
        budget.flips(timeline, devices),
        dual_miss.dual_miss(trace, devices),
        prediction.prediction(trace, devices),
    ]
    by_name = {r.analysis.value: r for r in results}
    if by_name["co_burst"].rows:
        by_name["co_burst"].figures.append(
            figures.co_burst_figure(
                by_name["co_burst"], out_dir / f"{name}-co_burst.png", f"{title}: co-burst"
            )
        )
    grid_budgets, p99 = budget.budget_grid(timeline, devices[0])
    by_name["marginal_value"].figures.append(
        figures.budget_figure(grid_budgets, p99, out_dir / f"{name}-budget.png", f"{devices[0].name}: P99 TPOT")
    )
    by_name["flips"].figures.append(
        figures.flips_figure(by_name["flips"], out_dir / f"{name}-flips.png", f"{title}: best split")
    )
    if by_name["dual_miss"].rows:
        by_name["dual_miss"].figures.append(
            figures.dual_miss_figure(by_name["dual_miss"], out_dir / f"{name}-dual_miss.png", "dual-miss crossover")
        )
    by_name["prediction"].figures.append(
        figures.prediction_figure(by_name["prediction"], out_dir / f"{name}-prediction.png", "prediction")
    )
    if not any(not d.is_what_if for d in devices):
        by_name["marginal_value"].notes.append("no measured device model (no I/O rows, no profile): what-ifs only")
    return TraceAnalysis(trace, results, [d.name for d in devices], label)


def store(ledger: Ledger, analysis: TraceAnalysis, run_id: int | None = None) -> int:
    """Replace the ledger's rows of this trace with the analysis's; returns how many were stored."""
    path = str(analysis.trace.path.resolve())
    return store_trace_analyses(ledger, path, analysis.trace.workload, analysis.ledger_rows(), run_id)

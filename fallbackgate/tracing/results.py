"""What an analysis yields: rows for the ledger's ``trace_analyses`` table, and the figures it drew."""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path
from typing import Any


class Analysis(str, enum.Enum):
    """The analyses of ``fallbackgate trace analyze``, as the ledger names them."""

    CO_BURST = "co_burst"
    MARGINAL_VALUE = "marginal_value"
    FLIPS = "flips"
    DUAL_MISS = "dual_miss"
    PREDICTION = "prediction"
    DEVICES = "devices"


@dataclasses.dataclass(slots=True)
class AnalysisRow:
    """One number an analysis found."""

    analysis: Analysis  # which analysis
    metric: str  # what the number is, e.g. "lift", "num_flips"
    value: float  # the number (nan: not computable on this trace)
    unit: str = ""  # "", "ns", "bytes", "ms", "s", "steps", "share", ...
    ci_low: float | None = None  # 95 % interval, where the analysis gives one
    ci_high: float | None = None
    device: str = ""  # the device model it was priced on ("" when none)
    params: dict[str, Any] = dataclasses.field(default_factory=dict)  # lag, window, phase, budgets, ...


@dataclasses.dataclass(slots=True)
class AnalysisResult:
    """An analysis's rows, its figures on disk and any notes on what it could not answer."""

    analysis: Analysis  # which analysis
    rows: list[AnalysisRow] = dataclasses.field(default_factory=list)  # its numbers
    figures: list[Path] = dataclasses.field(default_factory=list)  # PNG files it wrote
    notes: list[str] = dataclasses.field(default_factory=list)  # what the trace did not allow, and why

    def value(self, metric: str, **params: Any) -> float:
        """The value of the first row with this metric (and these params, device included)."""
        device = params.pop("device", None)
        for row in self.rows:
            if row.metric == metric and (device is None or row.device == device):
                if all(row.params.get(k) == v for k, v in params.items()):
                    return row.value
        raise KeyError(f"{self.analysis.value}: no row {metric} {params} device={device}")

"""On a dual miss, which action wins? From the arbitration table: which option was chosen, by phase and
context length, and where the cheapest exact way to get the KV block (load it, or recompute it) flips,
re-priced on every device model.

Re-pricing: an option's predicted time is taken as the recorded device's read of its bytes plus a rest
(compute, overlap) that does not depend on the device; on another device the read is priced anew. Each
option's time is fitted linearly in the context length per phase; the crossover is where recompute's line
meets the cheapest load option's.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from fallbackgate.tracing.devices import DeviceModel
from fallbackgate.tracing.reader import Trace
from fallbackgate.tracing.results import Analysis, AnalysisResult, AnalysisRow
from fallbackgate.tracing.schema import TraceTable

LOAD_OPTIONS = ("expert_first", "kv_first")


def _fit(frame: pd.DataFrame, cost: str) -> tuple[float, float] | None:
    """(intercept, slope) of ``cost`` against context tokens, None when the contexts do not vary."""
    x = frame["context_tokens"].to_numpy(np.float64)
    if len(x) < 2 or np.ptp(x) == 0:
        return None
    slope, intercept = np.polyfit(x, frame[cost].to_numpy(np.float64), 1)
    return float(intercept), float(slope)


def crossover_tokens(options: pd.DataFrame, cost: str) -> float:
    """Context length where recompute stops beating the cheapest load option (nan: no crossing)."""
    fits = {name: _fit(group, cost) for name, group in options.groupby("option", observed=True)}
    recompute = fits.get("recompute")
    loads = [fits[name] for name in LOAD_OPTIONS if fits.get(name)]
    if not recompute or not loads:
        return float("nan")
    load = min(loads, key=lambda f: f[0] + f[1] * float(options["context_tokens"].median()))
    if recompute[1] == load[1]:
        return float("nan")
    return (load[0] - recompute[0]) / (recompute[1] - load[1])


def dual_miss(trace: Trace, devices: list[DeviceModel]) -> AnalysisResult:
    """Chosen-option shares per phase and context bucket, and the recompute-versus-load crossover per device."""
    result = AnalysisResult(Analysis.DUAL_MISS)
    options = trace.frame(TraceTable.ARBITRATION)
    if options.empty:
        result.notes.append(
            "the trace has no arbitration rows (its controller weighed no late object's options): nothing to compare"
        )
        return result
    options["option"] = options["option"].astype(str)
    options["phase"] = options["phase"].astype(str)
    chosen = options[options["is_chosen"]]
    edges, labels = [-np.inf, 256, 1024, 4096, np.inf], ["<256", "<1k", "<4k", ">=4k"]
    buckets = pd.cut(chosen["context_tokens"], edges, labels=labels)
    shares = chosen.groupby([chosen["phase"], buckets], observed=True)["option"].value_counts(normalize=True)
    for (phase, bucket, option), share in shares.items():
        result.rows.append(AnalysisRow(Analysis.DUAL_MISS, "chosen_share", float(share), "share",
                                       params={"phase": phase, "context": str(bucket), "option": option}))  # fmt: skip
    recorded = devices[0] if devices and not devices[0].is_what_if else None
    for device in devices:
        rest = options["predicted_ns"] - (recorded.read_ns(options["bytes"]) if recorded else 0) * (
            options["bytes"] > 0
        )
        rest = rest.clip(lower=0)  # a recorded device priced above the controller's own prediction leaves no rest
        options["cost"] = rest + device.read_ns(options["bytes"]) * (options["bytes"] > 0)
        for phase, group in options.groupby("phase"):
            tokens = crossover_tokens(group, "cost")
            result.rows.append(AnalysisRow(Analysis.DUAL_MISS, "recompute_crossover_tokens", tokens, "tokens",
                                           device=device.name, params={"phase": phase}))  # fmt: skip
    if recorded is None:
        result.notes.append("no measured device model: options were priced as recorded and on the what-ifs only")
    return result

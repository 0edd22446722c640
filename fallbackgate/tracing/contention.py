"""Do the two kinds of I/O contend? From the io table: the share of each kind's busy read time during which a
read of the other kind was also in flight, and the queue depth reads met at submit."""

from __future__ import annotations

import numpy as np

from fallbackgate.tracing.reader import Trace
from fallbackgate.tracing.results import Analysis, AnalysisRow
from fallbackgate.tracing.schema import TraceTable


def union(starts: np.ndarray, ends: np.ndarray) -> list[tuple[int, int]]:
    """Disjoint, sorted intervals covering the given [start, end) intervals."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(zip(starts.tolist(), ends.tolist(), strict=True)):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    """Total length of the intersection of two disjoint sorted interval lists."""
    total, i, j = 0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def contention_rows(trace: Trace) -> list[AnalysisRow]:
    """Overlap shares per kind and the mean queue depth at submit (no rows when the trace has no reads)."""
    io = trace.frame(TraceTable.IO)
    io = io[io["op"].astype(str) == "read"]
    if io.empty:
        return []
    kinds = io["object_kind"].astype(str)
    busy = {k: union(io.loc[kinds == k, "start_ns"].to_numpy(), io.loc[kinds == k, "end_ns"].to_numpy())
            for k in ("expert", "kv_block")}  # fmt: skip
    shared = overlap(busy["expert"], busy["kv_block"])
    rows = []
    for kind, name in (("expert", "io_overlap_share_expert"), ("kv_block", "io_overlap_share_kv")):
        length = sum(end - start for start, end in busy[kind])
        rows.append(
            AnalysisRow(Analysis.CO_BURST, name, shared / length if length else float("nan"), "share of busy time")
        )
    rows.append(AnalysisRow(Analysis.CO_BURST, "mean_queue_depth_at_submit", float(io["queue_depth"].mean()), "I/Os"))
    return rows

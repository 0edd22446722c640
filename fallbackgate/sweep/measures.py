"""Per-cell measures of a sweep run in the RAM-and-disk regime, from its outcome and its recorded trace.

Times are measured wall clock (``*_ms``), quantiles nearest-rank. Miss rates count objects, not rows: an
expert is one object per (step, layer) however many tokens route to it; a KV block one per (step, request,
layer, block); a miss is an access whose nearest copy was not in RAM (``tier_before`` other than device).
Bytes by tag are the events' ``bytes_moved``; bytes by tier are the trace's I/O rows (reads and writes of
the checkpoint and the spill). Stall seconds are the trace's per-access waits summed (time a step waited for
its objects).
"""

from __future__ import annotations

import math
import pathlib
from collections import Counter
from collections.abc import Sequence

import pandas as pd

from fallbackgate.batch.session import RunOutcome
from fallbackgate.policy.schema import Policy

DEVICE = "device"


def proc_io() -> dict[str, int]:
    """This process's I/O counters as the kernel keeps them (``/proc/self/io``: ``read_bytes`` is what really
    came from storage, page-cache hits excluded; all threads counted)."""
    lines = pathlib.Path("/proc/self/io").read_text().splitlines()
    return {key: int(value) for key, value in (line.split(": ") for line in lines if line)}


def reset_peak_rss() -> None:
    """Start this process's peak RSS over from its current RSS (``/proc/self/clear_refs``, Linux 4.0+)."""
    pathlib.Path("/proc/self/clear_refs").write_text("5")


def peak_rss_bytes() -> int:
    """This process's peak RSS since it started or since :func:`reset_peak_rss` (``VmHWM``)."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def latency_measures(outcome: RunOutcome, policy: Policy) -> dict[str, float]:
    """tokens/s over the run's wall time (arrival gaps included), TTFT and TPOT p50/p99, SLO attainment."""
    outputs = outcome.outputs
    ttft = [1e3 * o.ttft_s for o in outputs]
    tpot = [1e3 * o.tpot_s for o in outputs if len(o.output_token_ids) > 1]
    met = []
    for spec, out in zip(outcome.specs, outputs, strict=True):
        slo = policy.classes[spec.request_class].slo
        met.append(out.ttft_s * 1e3 <= slo.ttft_ms and out.tpot_s * 1e3 <= slo.tpot_ms)
    tokens = sum(len(o.output_token_ids) for o in outputs)
    return {
        "output_tokens": float(tokens),
        "wall_s": outcome.wall_s,
        "tokens_per_s": tokens / max(outcome.wall_s, 1e-9),
        "ttft_p50_ms": quantile(ttft, 0.5),
        "ttft_p99_ms": quantile(ttft, 0.99),
        "tpot_p50_ms": quantile(tpot, 0.5),
        "tpot_p99_ms": quantile(tpot, 0.99),
        "slo_attainment": sum(met) / max(1, len(met)),
    }


def tag_bytes(outcome: RunOutcome) -> dict[str, float]:
    """Bytes moved and objects served per object kind × tag (``bytes_<kind>_<tag>``, ``count_<kind>_<tag>``)."""
    moved: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for step in outcome.steps:
        for e in step.events:
            name = f"{e.object_kind.value}_{e.tag.value}"
            moved[name] += e.bytes_moved
            counts[name] += e.count
    out = {f"bytes_{k}": float(v) for k, v in sorted(moved.items()) if v}
    out.update({f"count_{k}": float(v) for k, v in sorted(counts.items()) if v})
    return out


def trace_measures(experts: pd.DataFrame, kv: pd.DataFrame, io: pd.DataFrame) -> dict[str, float]:
    """Miss rates, stall seconds and I/O bytes by kind × op × tier of one run's trace tables."""
    e_obj = experts.drop_duplicates(["step", "layer", "expert"])
    k_obj = kv.drop_duplicates(["step", "request", "layer", "block"])
    e_miss = e_obj["tier_before"].astype(str) != DEVICE
    k_miss = k_obj["tier_before"].astype(str) != DEVICE
    out = {
        "expert_accesses": float(len(e_obj)),
        "kv_accesses": float(len(k_obj)),
        "expert_miss_rate": float(e_miss.mean()) if len(e_obj) else 0.0,
        "kv_miss_rate": float(k_miss.mean()) if len(k_obj) else 0.0,
        "stall_expert_s": float(experts["ns"].sum()) / 1e9,
        "stall_kv_s": float(kv["ns"].sum()) / 1e9,
        "dual_miss_steps": float(len(set(e_obj.loc[e_miss, "step"]) & set(k_obj.loc[k_miss, "step"]))),
    }
    out["stall_s"] = out["stall_expert_s"] + out["stall_kv_s"]
    if len(io):
        grouped = io.groupby(["object_kind", "op", "tier"], observed=True)["bytes"].sum()
        for (kind, op, tier), value in grouped.items():
            out[f"io_{kind}_{op}_{tier}_bytes"] = float(value)
    out["io_read_bytes"] = float(io.loc[io["op"].astype(str) == "read", "bytes"].sum()) if len(io) else 0.0
    out["io_write_bytes"] = float(io.loc[io["op"].astype(str) == "write", "bytes"].sum()) if len(io) else 0.0
    return out


def read_bytes_of(metrics: dict[str, float]) -> float:
    """Bytes the run read to serve objects (expert loads and KV reads, any tag), as its events counted."""
    return sum(v for k, v in metrics.items() if k.startswith("bytes_") and not k.endswith("_resident"))

"""Does simulating a recorded run with its own configuration predict what it measured?

A recorded trace carries its configuration (``metadata.json``: controller, device budget, profile). The
simulation runs that controller at that budget over the trace's accesses and prices its misses on a device
model — by default the waits the steps recorded, fitted on a *calibration* trace (the same trace, or a
held-out run recorded under another budget), or the profile's disk, or ``--io real`` (the transfers
performed, plus the engine's own time per miss beyond its I/O as the calibration trace recorded it). Measured: the
trace's stall (every access row's wait, summed) and TPOT (per request, first token to finish over its
output tokens less one, from the requests table; averaged over requests). The bound is the issue's:
|predicted − measured| ≤ max(25 %, 1 ms per step) for the stall, and ≤ max(25 %, 1 ms) for the mean TPOT.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from fallbackgate.tracing.devices import DeviceModel, fit_waits
from fallbackgate.tracing.reader import Trace, read_trace
from fallbackgate.tracing.realio import RealIO, simulate_real
from fallbackgate.tracing.schema import TraceTable
from fallbackgate.tracing.simulate import SimulationConfig
from fallbackgate.tracing.simulate_run import simulate_many
from fallbackgate.tracing.writer import TraceFormatError


def recorded_budget(trace: Trace) -> int:
    """The device budget the trace was recorded under (bytes; 0 when not recorded)."""
    budgets = trace.metadata.get("budgets") or {}
    if budgets.get("device_bytes"):
        return int(budgets["device_bytes"])
    return int((budgets.get("expert_bytes") or 0) + (budgets.get("kv_bytes") or 0))


def recorded_outcome(trace: Trace) -> dict[str, float]:
    """What the run measured: stall (s), mean TPOT (ms, requests table) and the steps it took."""
    waits = sum(float(trace.frame(t)["ns"].sum()) for t in (TraceTable.EXPERT_ACCESS, TraceTable.KV_ACCESS))
    requests = trace.frame(TraceTable.REQUESTS)
    decoded = requests[requests["output_tokens"] > 1]
    tpot = (decoded["finish_ns"] - decoded["first_token_ns"]) / (decoded["output_tokens"] - 1)
    return {
        "stall_s": waits / 1e9, "mean_tpot_ms": float(tpot.mean() / 1e6) if len(tpot) else float("nan"),
        "num_steps": int(trace.tables[TraceTable.STEPS].num_rows),
    }  # fmt: skip


def engine_overhead_ns(trace: Trace) -> float:
    """The engine's own time per demand read beyond its I/O: the mean recorded wait of a miss less the mean
    submit-to-arrival time of the trace's demand reads (0 when either is missing)."""
    waits = [trace.frame(t) for t in (TraceTable.EXPERT_ACCESS, TraceTable.KV_ACCESS)]
    ns = np.concatenate([f["ns"].to_numpy()[(f["bytes"].to_numpy() > 0) & (f["ns"].to_numpy() > 0)] for f in waits])
    io = trace.frame(TraceTable.IO)
    demand = io[(io["op"] == "read") & (io["requester"] == "demand")]
    if not len(ns) or not len(demand):
        return 0.0
    return max(float(ns.mean() - (demand["end_ns"] - demand["submit_ns"]).mean()), 0.0)


def recorded_share(trace: Trace, given: float | None = None) -> float | None:
    """A static split's expert share: the one the trace records, else `given` (a ValueError where they differ)."""
    share = (trace.metadata.get("budgets") or {}).get("expert_fraction")
    if share is not None and given is not None and abs(float(share) - given) > 1e-9:
        raise ValueError(f"{trace.path}: recorded with expert_fraction {share}, not {given}")
    return given if share is None else float(share)


def within(predicted: float, measured: float, floor: float) -> bool:
    """The issue's bound: |predicted − measured| ≤ max(25 % of measured, floor)."""
    return bool(abs(predicted - measured) <= max(0.25 * abs(measured), floor))


def validate(
    path: str,
    calibration: str | None = None,
    device: DeviceModel | None = None,
    real: RealIO | None = None,
    expert_fraction: float | None = None,
    target: str | None = None,
) -> dict[str, Any]:
    """Simulate the trace at ``path`` with its own controller and budget; compare with what it measured.
    The device is ``device``, else the waits fitted on ``calibration`` (default: the trace itself); with
    ``real`` the transfers are performed instead. ``expert_fraction``: a static split's expert share where the
    trace does not record it (a ValueError where it records another). ``target``: another recorded run of the
    same requests whose controller, budget and split are simulated over this trace's accesses and whose
    measured stall and TPOT are predicted (a run the simulation has not seen)."""
    trace = read_trace(path)
    measured_trace = read_trace(target) if target else trace
    controller, budget = measured_trace.metadata.get("controller"), recorded_budget(measured_trace)
    if not controller or not budget:
        raise TraceFormatError(
            f"{target or path}: metadata.json records no controller or device budget to simulate with"
        )
    if device is None:
        device = fit_waits(read_trace(calibration) if calibration else trace)
        if device is None:
            raise TraceFormatError(f"{calibration or path}: too few recorded demand waits to fit a device model")
    share = recorded_share(measured_trace, expert_fraction)
    config = SimulationConfig(str(controller), budget, device, share)
    if real is not None:
        overhead = engine_overhead_ns(read_trace(calibration) if calibration else trace)
        real = dataclasses.replace(real, overhead_ns_per_read=overhead)
    predicted = simulate_real(path, [config], real)[0] if real else simulate_many(path, [config], jobs=1)[0]
    if "error" in predicted:
        raise TraceFormatError(f"{path}: the simulation failed: {predicted['error']}")
    measured = recorded_outcome(measured_trace)
    steps = measured["num_steps"]
    ok_stall = within(predicted["stall_s"], measured["stall_s"], 1e-3 * steps)
    ok_tpot = within(predicted["mean_tpot_ms"], measured["mean_tpot_ms"], 1.0)
    return {
        "trace": path, "target": target or path,
        "calibration": calibration or (path if device.name == "waits" else None),
        "controller": controller, "budget_bytes": budget, "expert_fraction": share, "device": predicted["device"],
        "io_overhead_ms_per_read": real.overhead_ns_per_read / 1e6 if real else None,
        "latency_ms": device.latency_ns / 1e6, "bandwidth_mb_s": device.bandwidth_bytes_per_s / 1e6,
        "measured": measured, "predicted": {k: predicted[k] for k in ("stall_s", "mean_tpot_ms", "p99_tpot_ms")},
        "misses_by_tag": predicted["misses_by_tag"],
        "stall_error": _relative(predicted["stall_s"], measured["stall_s"]),
        "tpot_error": _relative(predicted["mean_tpot_ms"], measured["mean_tpot_ms"]),
        "stall_within": ok_stall, "tpot_within": ok_tpot, "within_bound": ok_stall and ok_tpot,
    }  # fmt: skip


def _relative(predicted: float, measured: float) -> float:
    return float((predicted - measured) / measured) if measured else float(np.nan)

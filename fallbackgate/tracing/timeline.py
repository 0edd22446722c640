"""A trace's access sequences and step timing, laid out once for the analyses that price them.

A step's compute time is its recorded duration less the waits its accesses recorded; a simulated step lasts
that compute time plus the stall its simulated misses cost on a device model. A request's TPOT is the mean of
its decode steps' times; the P99 TPOT is taken over every (request, decode step) pair.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd

from fallbackgate.tracing.cachesim import AccessStream
from fallbackgate.tracing.devices import DeviceModel
from fallbackgate.tracing.reader import Trace
from fallbackgate.tracing.schema import TraceTable
from fallbackgate.tracing.writer import TraceFormatError


@dataclasses.dataclass(slots=True)
class Timeline:
    """Steps, both kinds' access streams and which requests ran in which decode step."""

    step_ids: np.ndarray  # steps.step, in order
    compute_ns: np.ndarray  # per step: duration less recorded waits
    experts: AccessStream  # expert accesses in trace order
    expert_step_index: np.ndarray  # per expert access: its step's position in step_ids
    kv: AccessStream
    kv_step_index: np.ndarray
    decode_pairs: np.ndarray  # [n, 2]: (step position, request code) of every request in a decode step
    request_slo_ns: np.ndarray  # per request code: its TPOT SLO (nan: none)
    total_budget_bytes: float  # the recorded expert + KV budget (0: not recorded)
    base_budget_bytes: tuple[float, float]  # the recorded (expert, KV) budgets
    between_ns: np.ndarray | None = None  # per step: time from its end to the next step's start (host work)

    @property
    def num_steps(self) -> int:
        return len(self.step_ids)

    def step_ns(self, expert_bytes: float, kv_bytes: float, device: DeviceModel) -> np.ndarray:
        """Per step: compute plus the stall of both kinds' LRU misses at these capacities."""
        n = self.num_steps
        expert_misses = self.experts.misses_per_step(expert_bytes, self.expert_step_index, n)
        kv_misses = self.kv.misses_per_step(kv_bytes, self.kv_step_index, n)
        moved = expert_misses * self.experts.bytes_per_object + kv_misses * self.kv.bytes_per_object
        return self.compute_ns + device.stall_ns(expert_misses + kv_misses, moved)

    def outcome(self, step_ns: np.ndarray) -> dict[str, float]:
        """SLO violations (requests whose mean decode step time exceeds their TPOT SLO), P99 TPOT and stall."""
        if not len(self.decode_pairs):
            return {"slo_violations": 0.0, "p99_tpot_ms": float("nan"), "mean_tpot_ms": float("nan"), "stall_s": 0.0}
        times = step_ns[self.decode_pairs[:, 0]]
        codes = self.decode_pairs[:, 1]
        sums = np.bincount(codes, weights=times, minlength=len(self.request_slo_ns))
        counts = np.bincount(codes, minlength=len(self.request_slo_ns))
        tpot = np.divide(sums, counts, out=np.full(len(sums), np.nan), where=counts > 0)
        mean_tpot_ms = float(np.nanmean(tpot) / 1e6) if (counts > 0).any() else float("nan")
        slo = self.request_slo_ns
        violations = np.sum((counts > 0) & ~np.isnan(slo) & (tpot > np.nan_to_num(slo, nan=np.inf)))
        return {
            "slo_violations": float(violations),
            "p99_tpot_ms": float(np.percentile(times, 99) / 1e6),
            "mean_tpot_ms": mean_tpot_ms,
            "stall_s": float((step_ns - self.compute_ns).sum() / 1e9),
        }


def _codes(series: pd.Series, names: list[str]) -> np.ndarray:
    """Each value's index in ``names`` (which holds every value)."""
    categorical = series.astype("category")
    index = {name: i for i, name in enumerate(names)}
    mapping = np.array([index[str(c)] for c in categorical.cat.categories] + [-1], dtype=np.int64)
    return mapping[categorical.cat.codes.to_numpy()]


def build_timeline(trace: Trace) -> Timeline:
    """Lay out a trace for pricing; raises TraceFormatError when the metadata lacks the object sizes."""
    model = trace.metadata.get("model") or {}
    for key in ("bytes_per_expert", "bytes_per_kv_block", "num_experts"):
        if not model.get(key):
            raise TraceFormatError(f"{trace.path}: metadata.json model.{key} is needed to simulate caches")
    steps = trace.frame(TraceTable.STEPS).sort_values("step")
    experts, kv = trace.frame(TraceTable.EXPERT_ACCESS), trace.frame(TraceTable.KV_ACCESS)
    requests = trace.frame(TraceTable.REQUESTS)
    names = sorted(set(requests["request"]) | set(experts["request"].astype(str)) | set(kv["request"].astype(str)))
    step_ids = steps["step"].to_numpy()
    position = {int(s): i for i, s in enumerate(step_ids)}
    waits = experts.groupby("step")["ns"].sum().add(kv.groupby("step")["ns"].sum(), fill_value=0)
    compute = (steps["end_ns"] - steps["start_ns"]).to_numpy() - waits.reindex(step_ids, fill_value=0).to_numpy()
    e_step = np.searchsorted(step_ids, experts["step"].to_numpy())
    kv_step = np.searchsorted(step_ids, kv["step"].to_numpy())
    if (e_step >= len(step_ids)).any() or (kv_step >= len(step_ids)).any() or len(position) != len(step_ids):
        raise TraceFormatError(f"{trace.path}: accesses name steps the steps table does not have")
    e_keys = experts["layer"].to_numpy(np.int64) * int(model["num_experts"]) + experts["expert"].to_numpy(np.int64)
    num_layers = int(max(kv["layer"].max() if len(kv) else 0, model.get("num_layers", 1))) + 1
    kv_req = _codes(kv["request"], names)
    kv_keys = (kv_req * num_layers + kv["layer"].to_numpy(np.int64)) * (1 << 32) + kv["block"].to_numpy(np.int64)
    is_decode = (steps["phase"].astype(str) != "prefill").to_numpy()
    pair_steps = np.concatenate([e_step, kv_step])
    pair_codes = np.concatenate([_codes(experts["request"], names), kv_req])
    unique = np.unique(pair_steps * len(names) + pair_codes)
    decode_pairs = np.stack([unique // len(names), unique % len(names)], 1)
    decode_pairs = decode_pairs[is_decode[decode_pairs[:, 0]]] if len(decode_pairs) else decode_pairs.reshape(0, 2)
    slo = requests.set_index("request")["slo_tpot_ns"].reindex(names).to_numpy(np.float64)
    budgets = trace.metadata.get("budgets") or {}
    base = (float(budgets.get("expert_bytes") or 0), float(budgets.get("kv_bytes") or 0))
    ends, starts = steps["end_ns"].to_numpy(np.int64), steps["start_ns"].to_numpy(np.int64)
    between = np.maximum(np.append(starts[1:] - ends[:-1], 0), 0).astype(np.float64) if len(ends) else np.zeros(0)
    return Timeline(
        step_ids, compute.astype(np.float64),
        AccessStream.from_keys(experts["step"].to_numpy(), e_keys, int(model["bytes_per_expert"]), True), e_step,
        AccessStream.from_keys(kv["step"].to_numpy(), kv_keys, int(model["bytes_per_kv_block"]), False), kv_step,
        decode_pairs.astype(np.int64), slo, sum(base), base, between,
    )  # fmt: skip

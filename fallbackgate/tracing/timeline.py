"""A trace's access sequences and step timing, laid out once for the analyses that price them.

A step's compute time is its recorded duration less the waits its accesses recorded; a simulated step lasts
that compute time plus the stall its simulated misses cost on a device model. A request's TPOT is measured as
(finish − first token) / (output tokens − 1); priced the same way, it is the time of the steps that started
between its first token and its finish — each step with the host time before it (sampling, recording,
scheduling), which the cache does not change — over its output tokens less one. Idle time while the engine
waits for arrivals lies before a request's first token or after its finish, never in its window. A request
the requests table lacks is priced over the non-prefill steps it accessed; one with no TPOT there (fewer than
two tokens, no finish) is left out, as the measured TPOT leaves it out. The
P99 TPOT is taken over every (request, step of its window) pair.
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
    decode_pairs: np.ndarray  # [n, 2]: (step position, request code) of every step in a request's TPOT window
    request_slo_ns: np.ndarray  # per request code: its TPOT SLO (nan: none)
    total_budget_bytes: float  # the recorded expert + KV budget (0: not recorded)
    base_budget_bytes: tuple[float, float]  # the recorded (expert, KV) budgets
    between_ns: np.ndarray | None = None  # per step: time from its end to the next step's start (host work)
    num_tpot_tokens: np.ndarray | None = None  # per request code: output tokens − 1 (0: per step; -1: none)

    @property
    def before_ns(self) -> np.ndarray | None:
        """Per step: time from the previous step's end to its start (the host work a step's time includes)."""
        if self.between_ns is None:
            return None
        return np.concatenate([[0.0], self.between_ns[:-1]]) if len(self.between_ns) else self.between_ns

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
        """SLO violations (requests whose TPOT exceeds their TPOT SLO), mean and P99 TPOT and stall, each step
        lasting ``step_ns`` plus the recorded host time before it."""
        if not len(self.decode_pairs):
            return {"slo_violations": 0.0, "p99_tpot_ms": float("nan"), "mean_tpot_ms": float("nan"), "stall_s": 0.0}
        paced = step_ns + (self.before_ns if self.before_ns is not None else 0.0)
        times = paced[self.decode_pairs[:, 0]]
        codes = self.decode_pairs[:, 1]
        sums = np.bincount(codes, weights=times, minlength=len(self.request_slo_ns))
        counts = np.bincount(codes, minlength=len(self.request_slo_ns)).astype(np.float64)
        if self.num_tpot_tokens is not None:
            counts = np.where((counts > 0) & (self.num_tpot_tokens > 0), self.num_tpot_tokens, counts)
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
    ends, starts = steps["end_ns"].to_numpy(np.int64), steps["start_ns"].to_numpy(np.int64)
    gaps = np.maximum(starts[1:] - ends[:-1], 0).astype(np.float64)
    windows, num_tokens = _tpot_windows(requests, names, starts)
    accessed = _accessed_pairs(steps, np.concatenate([e_step, kv_step]),
                               np.concatenate([_codes(experts["request"], names), kv_req]), len(names))  # fmt: skip
    decode_pairs = np.concatenate([windows, accessed[num_tokens[accessed[:, 1]] == 0]])
    slo = requests.set_index("request")["slo_tpot_ns"].reindex(names).to_numpy(np.float64)
    budgets = trace.metadata.get("budgets") or {}
    base = (float(budgets.get("expert_bytes") or 0), float(budgets.get("kv_bytes") or 0))
    return Timeline(
        step_ids, compute.astype(np.float64),
        AccessStream.from_keys(experts["step"].to_numpy(), e_keys, int(model["bytes_per_expert"]), True), e_step,
        AccessStream.from_keys(kv["step"].to_numpy(), kv_keys, int(model["bytes_per_kv_block"]), False), kv_step,
        decode_pairs.astype(np.int64), slo, sum(base), base, np.append(gaps, 0.0) if len(ends) else np.zeros(0),
        num_tokens,
    )  # fmt: skip


def _tpot_windows(requests: pd.DataFrame, names: list[str], starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(step position, request code) of the steps that started after each request's first token and before
    its finish, and per request code its output tokens less one: 0 for a request the requests table lacks
    (priced over the steps it accessed), -1 for one with no TPOT (fewer than two tokens, never finished)."""
    num_tokens = np.zeros(len(names), dtype=np.float64)
    code_of = {name: i for i, name in enumerate(names)}
    pairs = []
    for row in requests.itertuples(index=False):
        first, finish = row.first_token_ns, row.finish_ns
        code = code_of[str(row.request)]
        num_tokens[code] = -1
        if row.output_tokens < 2 or pd.isna(first) or pd.isna(finish):
            continue
        lo, hi = np.searchsorted(starts, int(first), "left"), np.searchsorted(starts, int(finish), "left")
        if hi > lo:
            num_tokens[code] = row.output_tokens - 1
            pairs.append(np.stack([np.arange(lo, hi), np.full(hi - lo, code)], 1))
    return (np.concatenate(pairs) if pairs else np.zeros((0, 2), np.int64)), num_tokens


def _accessed_pairs(steps: pd.DataFrame, pair_steps: np.ndarray, pair_codes: np.ndarray, num_names: int) -> np.ndarray:
    """(step position, request code) of every request that accessed something in a non-prefill step."""
    is_decode = (steps["phase"].astype(str) != "prefill").to_numpy()
    unique = np.unique(pair_steps * num_names + pair_codes)
    pairs = np.stack([unique // num_names, unique % num_names], 1)
    return pairs[is_decode[pairs[:, 0]]] if len(pairs) else pairs.reshape(0, 2)

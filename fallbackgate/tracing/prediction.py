"""Does joint prediction add information? Three predictors over the trace's own accesses, scored by wrongly
predicted bytes (predicted, not used), the estimated share of those a prefetcher would have fetched, covered
miss bytes (predicted and recorded as a miss) and the link time that nets out on each device model.

- router: for a request's token at layer l+1, the top-k experts by co-occurrence with its layer-l experts,
  learned online from the trace so far (no look-ahead);
- KV recency: the blocks a request read at a layer in step t are predicted for step t+1;
- joint: both sets, each object predicted when either predictor names it (the union; it has no cross-kind
  signal of its own, so it adds information only where the co-burst analysis finds one).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from fallbackgate.tracing.devices import DeviceModel
from fallbackgate.tracing.reader import Trace
from fallbackgate.tracing.results import Analysis, AnalysisResult, AnalysisRow
from fallbackgate.tracing.schema import TraceTable


def router_predictions(experts: pd.DataFrame, num_layers: int, num_experts: int, top_k: int) -> tuple[int, int]:
    """(num_predicted, num_correct) of the online co-occurrence router predictor."""
    frame = experts[["step", "request", "layer", "expert"]].sort_values(["step", "request", "layer"], kind="stable")
    counts = np.zeros((max(num_layers - 1, 1), num_experts, num_experts), dtype=np.int64)
    num_predicted = num_correct = 0
    step = frame["step"].to_numpy()
    request = pd.Categorical(frame["request"].astype(str)).codes
    layer = frame["layer"].to_numpy(np.int64)
    expert = frame["expert"].to_numpy(np.int64)
    boundaries = np.flatnonzero(np.diff(step) | np.diff(request) | np.diff(layer)) + 1
    starts = np.concatenate([[0], boundaries])
    ends = np.concatenate([boundaries, [len(frame)]])
    previous: tuple[int, int, int, np.ndarray] | None = None
    for lo, hi in zip(starts, ends, strict=True):
        here = (int(step[lo]), int(request[lo]), int(layer[lo]))
        used = expert[lo:hi]
        if previous and previous[:2] == here[:2] and previous[2] == here[2] - 1:
            source_layer, used_before = previous[2], previous[3]
            scores = counts[source_layer, used_before].sum(axis=0)
            if scores.any():
                guess = np.argsort(-scores, kind="stable")[: min(top_k, int((scores > 0).sum()))]
                num_predicted += len(guess)
                num_correct += len(set(guess.tolist()) & set(used.tolist()))
            counts[source_layer][np.ix_(used_before, used)] += 1
        previous = (*here, used)
    return num_predicted, num_correct


def kv_predictions(kv: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Per block read at step t (with a later step in the trace): whether it was read again at step t+1, and
    whether that next read was a recorded miss (covered by a prefetch)."""
    request = pd.Categorical(kv["request"].astype(str)).codes.astype(np.int64)
    key = (request * 4096 + kv["layer"].to_numpy(np.int64)) * (1 << 24) + kv["block"].to_numpy(np.int64)
    steps = kv["step"].to_numpy(np.int64)
    order = np.unique(steps)
    position = np.searchsorted(order, steps)
    combined = position * (1 << 50) + key
    has_next = position < len(order) - 1
    wanted = (position + 1) * (1 << 50) + key
    sorted_combined = np.sort(combined)
    where = np.searchsorted(sorted_combined, wanted)
    found = (where < len(sorted_combined)) & (sorted_combined[np.minimum(where, len(sorted_combined) - 1)] == wanted)
    is_miss = kv["tier_before"].astype(str).to_numpy() != "device"
    miss_keys = np.sort(combined[is_miss])
    hit = np.searchsorted(miss_keys, wanted)
    if not len(miss_keys):  # nothing was a miss (e.g. an imported trace served from device throughout)
        return found, np.zeros(len(found), dtype=bool)
    covered = found & (hit < len(miss_keys)) & (miss_keys[np.minimum(hit, len(miss_keys) - 1)] == wanted)
    return found[has_next], covered[has_next]


def prediction(trace: Trace, devices: list[DeviceModel]) -> AnalysisResult:
    """Router, KV-recency and joint predictors scored in bytes and priced stall."""
    result = AnalysisResult(Analysis.PREDICTION)
    model = trace.metadata.get("model") or {}
    experts, kv = trace.frame(TraceTable.EXPERT_ACCESS), trace.frame(TraceTable.KV_ACCESS)
    e_bytes, kv_bytes = int(model.get("bytes_per_expert", 0)), int(model.get("bytes_per_kv_block", 0))
    num_predicted, num_correct = router_predictions(
        experts, int(model.get("num_layers", experts["layer"].max() + 1)),
        int(model.get("num_experts", experts["expert"].max() + 1)), int(model.get("top_k", 2)),
    )  # fmt: skip
    e_miss_rate = float(np.mean(experts["tier_before"].astype(str) != "device")) if len(experts) else 0.0
    found, covered = kv_predictions(kv) if len(kv) else (np.zeros(0, bool), np.zeros(0, bool))
    kv_miss_rate = float(np.mean(kv["tier_before"].astype(str) != "device")) if len(kv) else 0.0
    scores = {  # predicted, correct, covered miss bytes, wrong bytes, wrong bytes a prefetcher would fetch
        "router": (num_predicted, num_correct, num_correct * e_miss_rate * e_bytes,
                   (num_predicted - num_correct) * e_bytes, (num_predicted - num_correct) * e_bytes * e_miss_rate),
        "kv_recency": (len(found), int(found.sum()), float(covered.sum()) * kv_bytes,
                       (len(found) - int(found.sum())) * kv_bytes,
                       (len(found) - int(found.sum())) * kv_bytes * kv_miss_rate),
    }  # fmt: skip
    joint = tuple(a + b for a, b in zip(scores["router"], scores["kv_recency"], strict=True))
    for name, score in {**scores, "joint": joint}.items():
        _rows(result, name, *score, devices)
    result.notes.append(
        "which unused predictions were already resident is not in the trace: covered router misses and fetched "
        "wrong bytes are estimated with the kind's recorded miss rate; the joint predictor is the union of the two"
    )
    return result


def _rows(result: AnalysisResult, name: str, predicted: int, correct: int, covered_bytes: float,
          wrong_bytes: float, fetched_wrong_bytes: float, devices: list[DeviceModel]) -> None:  # fmt: skip
    params = {"predictor": name}
    result.rows.append(AnalysisRow(Analysis.PREDICTION, "precision", correct / predicted if predicted else np.nan,
                                   "share", params=params))  # fmt: skip
    result.rows.append(AnalysisRow(Analysis.PREDICTION, "wrongly_predicted_bytes", float(wrong_bytes), "bytes",
                                   params=params))  # fmt: skip
    result.rows.append(AnalysisRow(Analysis.PREDICTION, "wrongly_fetched_bytes", float(fetched_wrong_bytes),
                                   "bytes (estimated)", params=params))  # fmt: skip
    result.rows.append(AnalysisRow(Analysis.PREDICTION, "covered_miss_bytes", float(covered_bytes), "bytes",
                                   params=params))  # fmt: skip
    for device in devices:
        saved = covered_bytes * 1e9 / device.bandwidth_bytes_per_s
        wasted = fetched_wrong_bytes * 1e9 / device.bandwidth_bytes_per_s
        result.rows.append(AnalysisRow(Analysis.PREDICTION, "net_link_time_saved_s", (saved - wasted) / 1e9, "s",
                                       device=device.name, params=params))  # fmt: skip

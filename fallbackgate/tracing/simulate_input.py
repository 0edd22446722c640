"""A trace's accesses grouped per step (`SimulationInput`), read once and shared by every configuration
simulated over it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd

from fallbackgate.tracing.reader import read_trace
from fallbackgate.tracing.schema import TraceTable
from fallbackgate.tracing.timeline import Timeline, build_timeline


@dataclasses.dataclass(slots=True)
class SimulationInput:
    """A trace's accesses grouped per step, ready for any number of configurations."""

    timeline: Timeline  # compute times, decode pairs, SLOs
    model: dict[str, int]  # num_layers, num_experts, top_k, bytes_per_expert, bytes_per_kv_block, block_size
    step_ids: list[int]  # steps in order
    phases: list[str]  # their phases
    step_requests: list[list[str]]  # requests with accesses in each step
    kv_rows: list[list[tuple[str, int, int]]]  # per step: (request, layer, block) in trace order
    kv_hashes: list[list[int]]  # per step: each KV row's content hash (0: none), as kv_rows
    last_read: dict[int, int]  # content hash -> the last step index that reads it
    expert_rows: list[list[tuple[int, int, str, float]]]  # per step: (layer, expert, request, router weight)
    classes: dict[str, str]  # request -> class
    finished: list[list[str]]  # per step: requests whose last access it is (their KV is freed after it)
    is_prefix_reused: bool = True  # the run kept finished requests' blocks (traces before stop 48: assumed)


def load_input(path: str) -> SimulationInput:
    """Read a trace and group its accesses per step."""
    trace = read_trace(path)
    timeline = build_timeline(trace)
    steps = trace.frame(TraceTable.STEPS).sort_values("step")
    step_ids = steps["step"].tolist()
    kv = trace.frame(TraceTable.KV_ACCESS).astype({"request": str})
    kv["content_hash"] = trace.tables[TraceTable.KV_ACCESS].column("content_hash").fill_null(0).to_numpy()  # exact
    experts = trace.frame(TraceTable.EXPERT_ACCESS).astype({"request": str})
    kv_groups = {s: list(zip(g["request"], g["layer"].tolist(), g["block"].tolist(), strict=True))
                 for s, g in kv.groupby("step", sort=False)}  # fmt: skip
    hash_groups = {s: [int(h) for h in g] for s, g in kv.groupby("step", sort=False)["content_hash"]}
    hashed = kv[kv["content_hash"] != 0]
    positions = np.searchsorted(np.asarray(step_ids), hashed["step"].to_numpy())
    last_read = pd.Series(positions).groupby(hashed["content_hash"].to_numpy()).max()
    expert_groups = {s: list(zip(g["layer"].tolist(), g["expert"].tolist(), g["request"], g["router_weight"].tolist(),
                                 strict=True)) for s, g in experts.groupby("step", sort=False)}  # fmt: skip
    requests = pd.concat([kv[["step", "request"]], experts[["step", "request"]]]).drop_duplicates()
    by_step = requests.groupby("step")["request"].apply(list).to_dict()
    last = requests.groupby("request")["step"].max()
    finished = last.reset_index().groupby("step")["request"].apply(list).to_dict()
    table = trace.frame(TraceTable.REQUESTS)
    model = {k: int(v) for k, v in (trace.metadata.get("model") or {}).items() if isinstance(v, int | float)}
    return SimulationInput(
        timeline, model, step_ids, steps["phase"].astype(str).tolist(), [by_step.get(s, []) for s in step_ids],
        [kv_groups.get(s, []) for s in step_ids], [hash_groups.get(s, []) for s in step_ids],
        {int(h): int(i) for h, i in last_read.items()}, [expert_groups.get(s, []) for s in step_ids],
        dict(zip(table["request"], table["request_class"], strict=True)), [finished.get(s, []) for s in step_ids],
        bool(trace.metadata.get("prefix_reuse", True)),
    )  # fmt: skip

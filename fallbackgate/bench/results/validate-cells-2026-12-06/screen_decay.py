"""python screen_decay.py DECAYS WORKLOADS POINTS_JSON
(e.g. 0.7,0.8,0.9,0.95,0.98 mixed,multi-turn,short-chat points.json)

The joint controller's routing_decay screened in the trace simulator over the joint traces bench.validate_cells
kept: its expert misses (waits fitted on each trace) per decay, and their geometric mean over decay 0.9's."""

import json
import statistics
import sys

from fallbackgate.controllers import registry
from fallbackgate.policy.schema import Policy
from fallbackgate.tracing import simulator
from fallbackgate.tracing.devices import fit_waits
from fallbackgate.tracing.reader import read_trace
from fallbackgate.tracing.simulate import SimulationConfig
from fallbackgate.tracing.simulate_input import load_input
from fallbackgate.tracing.validate import recorded_budget

decays = [float(x) for x in sys.argv[1].split(",")]
workloads = sys.argv[2].split(",")
points = [p for p in json.load(open(sys.argv[3])) if p["workload"] in workloads and p["controller"] == "joint"]
original = registry.make_controller
results: dict[float, list[tuple[int, float, float]]] = {d: [] for d in decays}
for p in points:
    trace, data = read_trace(p["trace"]), load_input(p["trace"])
    config = SimulationConfig("joint", recorded_budget(trace), fit_waits(trace))
    for decay in decays:
        policy = Policy.model_validate({"controller": {"routing_decay": decay}})
        simulator.make_controller = lambda kind, _policy=None, _p=policy, **kw: original(kind, _p, **kw)
        r = simulator.Simulator(data, config).run()
        results[decay].append((r["misses_by_tag"].get("expert:exact_load", 0), r["stall_s"], r["p99_tpot_ms"]))
    print(p["workload"], p["seed"], p["ram_frac"], " ".join(f"{d}:{results[d][-1][0]}" for d in decays), flush=True)
simulator.make_controller = original
for decay in decays:
    ratio = [a[0] / b[0] for a, b in zip(results[decay], results[0.9], strict=True)]
    p99 = statistics.fmean(x[2] for x in results[decay])
    print(decay, f"misses / decay-0.9 geomean {statistics.geometric_mean(ratio):.3f}", f"p99 mean {p99:.2f}")

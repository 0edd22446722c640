"""python3 fallbackgate/bench/results/h100-2026-12-05/moe_layer_profile.py CKPT OUT_DIR [BATCH]

torch.profiler over bench.moe_layer's pair: what each experts call does on the host (device-run-profile.sh).
"""

import collections
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import fallbackgate.bench.moe_layer as ml

_init = ml.LayerTimer.__init__


def _labelled_init(self, engine):
    _init(self, engine)
    run = engine.executor.run_experts
    kind = "budget" if engine.config.device_budget_bytes else "resident"

    def labelled(module, layer, hidden, index, weights):
        with record_function(f"{kind}_experts_{hidden.shape[0]}"):
            return run(module, layer, hidden, index, weights)

    engine.executor.run_experts = labelled


ml.LayerTimer.__init__ = _labelled_init
torch.set_grad_enabled(False)
batch = int(sys.argv[3]) if len(sys.argv) > 3 else 32
acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
with profile(activities=acts) as prof:
    row = ml._run_pair(sys.argv[1], batch, 0.8, seed=batch)
print(json.dumps(row))
events = list(prof.events())
out = {}
for kind in ("budget", "resident"):
    label = f"{kind}_experts_{batch}"
    ranges = [(e.time_range.start, e.time_range.end) for e in events if e.name == label]
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CPU or e.name == label:
            continue
        s = e.time_range.start
        if any(a <= s and e.time_range.end <= b for a, b in ranges):
            by_name[e.name][0] += 1
            by_name[e.name][1] += e.self_cpu_time_total
    n = max(1, len(ranges))
    wall = sum(b - a for a, b in ranges) / n
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:40]
    out[kind] = {
        "num_calls": len(ranges),
        "wall_us_per_call": wall,
        "ops": [{"name": k, "count_per_call": c / n, "self_cpu_us_per_call": t / n} for k, (c, t) in top],
    }
    print(f"== {kind} batch {batch}: {len(ranges)} calls, {wall:.0f} us each (profiled)")
    for k, (c, t) in top[:25]:
        print(f"{t / n:9.0f} us {c / n:8.1f}x  {k}")
json.dump({"row": row, "calls": out}, open(f"{sys.argv[2]}/profile-b{batch}.json", "w"), indent=1)
sort_by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
tbl = prof.key_averages().table(sort_by=sort_by, row_limit=40)
open(f"{sys.argv[2]}/profile-b{batch}-table.txt", "w").write(tbl)

"""python phases.py SEEDS CONTROLLERS [WORKLOAD]   e.g. 41,42,...,48 joint,static_split:0.3 multi-turn

Wall clock of an engine step's phases in the sweep's own cells at RAM 0.25 (against seeds 50-59's SLO targets):
the step, its schedule, KV resolution (`_prepare`: spilled blocks read back), forward (and its exposed expert
reads), `make_room`, the controller's hooks and the step's end (`_end_step`: the controller's spills, evictions
and promotions). Means in ms per step, prefill-carrying steps apart from decode-only ones; seeds interleaved."""

import functools
import json
import statistics
import sys
import tempfile
import time

from fallbackgate.controllers.registry import controller_class
from fallbackgate.engine.experts.executor import Executor
from fallbackgate.engine.kv.store import KVStore
from fallbackgate.engine.model.runner import ModelRunner
from fallbackgate.engine.scheduler import Scheduler
from fallbackgate.engine.stepping import EngineStepping
from fallbackgate.ledger.db import open_ledger
from fallbackgate.sweep.regime import RegimeConfig, run_regime
from fallbackgate.tinymoe import CHECKPOINT_DIR

SLO_FROM = "fallbackgate/sweep_results/seeds50-59/sweep.json"
current: dict[str, float] = {}  # the running step's phase seconds
rows: dict[str, list[dict]] = {}  # controller label -> one row per step
label = [""]


def timed(cls: type, name: str, key: str) -> None:
    method = getattr(cls, name)

    @functools.wraps(method)
    def call(*args, **kwargs):
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            if "t0" in current:
                current[key] = current.get(key, 0.0) + time.perf_counter() - started

    setattr(cls, name, call)


original_step = EngineStepping.step


def step(self):
    current.clear()
    current["t0"] = time.perf_counter()
    result = original_step(self)
    row = {k: v for k, v in current.items() if k != "t0"}
    row["total"] = time.perf_counter() - current["t0"]
    row["exposed"] = result.transfer.exposed_s if result.transfer is not None else 0.0
    row["is_prefill"] = any(n > 1 for n in self.last_plan.num_tokens.values())
    rows.setdefault(label[0], []).append(row)
    return result


def main() -> None:
    seeds, kinds = [int(s) for s in sys.argv[1].split(",")], sys.argv[2].split(",")
    workload = sys.argv[3] if len(sys.argv) > 3 else "multi-turn"
    EngineStepping.step = step
    for cls, name in [(KVStore, "finish_writes"), (Scheduler, "schedule"), (EngineStepping, "_prepare"),
                      (EngineStepping, "_forward"), (EngineStepping, "_end_step"), (Executor, "make_room"),
                      (ModelRunner, "forward")]:  # fmt: skip
        timed(cls, name, name)
    hooked = set()
    references = json.load(open(SLO_FROM))["slo_references"]
    with tempfile.TemporaryDirectory() as scratch:
        for seed in seeds:
            for kind in kinds:
                controller, _, share = kind.partition(":")
                cls = controller_class(controller)
                if cls not in hooked:
                    for hook in ("on_step_start", "on_step_end", "expert_action", "kv_action"):
                        timed(cls, hook, "ctl_" + hook)
                    hooked.add(cls)
                label[0] = kind
                cfg = RegimeConfig(
                    model_dir=str(CHECKPOINT_DIR),
                    workloads=(workload,),
                    seeds=(seed,),
                    ram_fracs=(0.25,),
                    kv_shares=(float(share or 0.3),),
                    controllers=(controller,),
                    slo_from={workload: references[workload]},
                    lowbit_dir=f"{scratch}/lowbit",
                )
                run_regime(cfg, open_ledger(f"sqlite:///{scratch}/ledger.sqlite"), log=lambda line: None)
    for kind, mine in rows.items():
        for is_prefill in (True, False):
            sel = [r for r in mine if r["is_prefill"] == is_prefill]
            keys = sorted({k for r in sel for k in r} - {"is_prefill"})
            parts = " ".join(f"{k}={1e3 * statistics.fmean(r.get(k, 0.0) for r in sel):.2f}" for k in keys)
            print(kind, "prefill" if is_prefill else "decode", len(sel), "steps:", parts)


if __name__ == "__main__":
    main()

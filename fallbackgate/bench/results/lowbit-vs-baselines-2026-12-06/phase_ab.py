"""python phase_ab.py SEEDS WORKLOADS RAM OUT.json: joint with lowbit_colder admission and the best-effort budget
opened, as shipped (any step) and admitting only in the request's decode steps (not while it prefills), seed by seed
interleaved, against seeds 50-59's SLO targets."""

import json
import sys
import tempfile

import yaml

from fallbackgate.controllers.joint import JointController
from fallbackgate.ledger.db import open_ledger
from fallbackgate.sweep.regime import RegimeConfig, run_regime
from fallbackgate.sweep.summary import expert_read_bytes
from fallbackgate.tinymoe import CHECKPOINT_DIR

mode = {"decode_only": False}
orig_start, orig_admit = JointController.on_step_start, JointController._lowbit_when_colder


def on_step_start(self, plan, view):
    self.prefilling = {r for r in plan.request_ids if plan.num_tokens[r] > 1}
    return orig_start(self, plan, view)


def admit(self, miss, budget):
    if mode["decode_only"] and miss.request_id in self.prefilling:
        return None
    return orig_admit(self, miss, budget)


JointController.on_step_start, JointController._lowbit_when_colder = on_step_start, admit
seeds = [int(s) for s in sys.argv[1].split(",")]
wls = sys.argv[2].split(",")
ram = float(sys.argv[3])
refs = json.load(open("fallbackgate/sweep_results/seeds50-59/sweep.json"))["slo_references"]
budgets = yaml.safe_load(open("fallbackgate/bench/results/lowbit-frontier-2026-12-06/best-effort-open.yaml"))
rows = []
with tempfile.TemporaryDirectory() as scratch:
    for seed in seeds:
        for wl in wls:
            for decode_only in (False, True):
                mode["decode_only"] = decode_only
                cfg = RegimeConfig(
                    model_dir=str(CHECKPOINT_DIR),
                    workloads=(wl,),
                    seeds=(seed,),
                    ram_fracs=(ram,),
                    controllers=("joint",),
                    expert_admission="lowbit_colder",
                    class_budgets=budgets,
                    slo_from={wl: refs[wl]},
                    lowbit_dir=f"{scratch}/lowbit",
                )
                for p in run_regime(cfg, open_ledger(f"sqlite:///{scratch}/ledger.sqlite"), log=lambda line: None)[
                    "points"
                ]:
                    m = p["metrics"]
                    row = {
                        "seed": seed,
                        "workload": wl,
                        "decode_only": decode_only,
                        "over_min": expert_read_bytes(m) / m["belady_expert_bytes_same_room"],
                        **{
                            k: m.get(k, 0.0)
                            for k in (
                                "tpot_p99_ms",
                                "ttft_p50_ms",
                                "slo_attainment",
                                "count_expert_expert_lowbit",
                                "stall_s",
                                "mean_kl",
                                "load_avg_1m",
                            )
                        },
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
json.dump(rows, open(sys.argv[4], "w"), indent=1)

"""python inline_ab.py SEEDS WORKLOAD RAM OUT.json [queued-only]: joint (default admission, the sweep's budgets) with
persisted low-bit copies read through the engine's I/O queue (as shipped) and read inline (io detached: the code
before 483715b), seed by seed interleaved, against seeds 50-59's SLO targets.
Per run: P99 TPOT, SLO, low-bit uses, stall."""

import json
import sys
import tempfile

from fallbackgate.engine import engine as engine_mod
from fallbackgate.ledger.db import open_ledger
from fallbackgate.sweep.regime import RegimeConfig, run_regime
from fallbackgate.tinymoe import CHECKPOINT_DIR

mode = {"inline": False}
MODES = (False, True) if len(sys.argv) < 6 else (False,)
orig_init = engine_mod.Engine.__init__


def init(self, *a, **k):
    orig_init(self, *a, **k)
    if mode["inline"] and self.expert_store.lowbit_cache is not None:
        self.expert_store.lowbit_cache.io = None


engine_mod.Engine.__init__ = init
seeds = [int(s) for s in sys.argv[1].split(",")]
wl = sys.argv[2]
ram = float(sys.argv[3])
refs = json.load(open("fallbackgate/sweep_results/seeds50-59/sweep.json"))["slo_references"]
rows = []
with tempfile.TemporaryDirectory() as scratch:
    for seed in seeds:
        for inline in MODES:
            mode["inline"] = inline
            cfg = RegimeConfig(
                model_dir=str(CHECKPOINT_DIR),
                workloads=(wl,),
                seeds=(seed,),
                ram_fracs=(ram,),
                controllers=("joint",),
                slo_from={wl: refs[wl]},
                lowbit_dir=f"{scratch}/lowbit",
            )
            res = run_regime(cfg, open_ledger(f"sqlite:///{scratch}/ledger.sqlite"), log=lambda line: None)
            pts = res["points"] if isinstance(res, dict) else res
            for p in pts:
                m = p["metrics"]
                rows.append(
                    {
                        "seed": seed,
                        "inline": inline,
                        **{
                            k: m.get(k, 0.0)
                            for k in (
                                "tpot_p99_ms",
                                "slo_attainment",
                                "count_expert_expert_lowbit",
                                "stall_s",
                                "read_bytes",
                                "ttft_p50_ms",
                                "load_avg_1m",
                                "mean_kl",
                            )
                        },
                    }
                )
                print(rows[-1], flush=True)
json.dump(rows, open(sys.argv[4], "w"), indent=1)

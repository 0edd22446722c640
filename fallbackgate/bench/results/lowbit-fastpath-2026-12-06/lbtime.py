"""python lbtime.py SEEDS WORKLOAD RAM: wall time of joint's expert_lowbit computations (lowbit_colder, best-effort
opened) in prefill-carrying and decode steps: the whole _run_single, its fetch (read + dequant), its room-making."""

import collections
import json
import sys
import tempfile
import time

import yaml

from fallbackgate.engine.experts import miss_fetch
from fallbackgate.engine.experts.executor import Executor
from fallbackgate.engine.experts.lowbit_cache import LowbitDiskCache
from fallbackgate.engine.experts.miss_fetch import MissFetching
from fallbackgate.engine.stepping import EngineStepping
from fallbackgate.ledger.db import open_ledger
from fallbackgate.sweep.regime import RegimeConfig, run_regime
from fallbackgate.tinymoe import CHECKPOINT_DIR

acc = collections.defaultdict(float)
cnt = collections.Counter()
state = {"prefill": False}
orig_step = EngineStepping.step


def step(self):
    t0 = time.perf_counter()
    r = orig_step(self)
    ph = "prefill" if any(n > 1 for n in self.last_plan.num_tokens.values()) else "decode"
    acc[ph + ":step"] += time.perf_counter() - t0
    cnt[ph + ":step"] += 1
    for k in [k for k in acc if k.startswith("cur:")]:
        acc[ph + k[3:]] += acc.pop(k)
    for k in [k for k in cnt if k.startswith("cur:")]:
        cnt[ph + k[3:]] += cnt.pop(k)
    return r


EngineStepping.step = step
orig_run = MissFetching._run_single


def run_single(self, module, key, tag, *a, **k):
    t0 = time.perf_counter()
    r = orig_run(self, module, key, tag, *a, **k)
    acc["cur:" + tag.value] += time.perf_counter() - t0
    cnt["cur:" + tag.value] += 1
    return r


MissFetching._run_single = run_single
orig_fetch = miss_fetch.fetch_for_tag


def fetch(store, key, tag, mr):
    t0 = time.perf_counter()
    r = orig_fetch(store, key, tag, mr)
    acc["cur:fetch_" + tag.value] += time.perf_counter() - t0
    return r


miss_fetch.fetch_for_tag = fetch

orig_get, orig_q = LowbitDiskCache.get, LowbitDiskCache._queued


def get(self, key):
    t0 = time.perf_counter()
    r = orig_get(self, key)
    acc["cur:cache_get"] += time.perf_counter() - t0
    cnt["cur:cache_get"] += 1
    return r


def queued(self, name, slot):
    t0 = time.perf_counter()
    r = orig_q(self, name, slot)
    acc["cur:cache_read_wait"] += time.perf_counter() - t0
    return r


LowbitDiskCache.get, LowbitDiskCache._queued = get, queued

orig_er = Executor.ensure_room


def ensure_room(self, *a, **k):
    t0 = time.perf_counter()
    r = orig_er(self, *a, **k)
    acc["cur:ensure_room"] += time.perf_counter() - t0
    cnt["cur:ensure_room"] += 1
    return r


Executor.ensure_room = ensure_room
seeds = [int(s) for s in sys.argv[1].split(",")]
wl = sys.argv[2]
ram = float(sys.argv[3])
refs = json.load(open("fallbackgate/sweep_results/seeds50-59/sweep.json"))["slo_references"]
budgets = yaml.safe_load(open("fallbackgate/bench/results/lowbit-frontier-2026-12-06/best-effort-open.yaml"))
with tempfile.TemporaryDirectory() as scratch:
    for seed in seeds:
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
        run_regime(cfg, open_ledger(f"sqlite:///{scratch}/ledger.sqlite"), log=lambda line: None)
for k in sorted(acc):
    print(f"{k:28s} {1e3 * acc[k]:9.1f} ms  n={cnt.get(k, 0)}")

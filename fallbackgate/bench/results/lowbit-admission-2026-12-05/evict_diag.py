"""python fallbackgate/bench/results/lowbit-admission-2026-12-05/evict_diag.py sweep ...

Runs ``fallbackgate sweep`` counting why experts leave RAM, by the caller of each eviction: an exact load in the
forward making room, room made for KV, or the step-end actions (rebalancing).
"""

import collections
import runpy
import sys
import traceback

from fallbackgate.engine.experts.store import ExpertStore

COUNTS: collections.Counter = collections.Counter()
_evict, _evict_chosen = ExpertStore.evict, ExpertStore.evict_chosen
LOAD_CALLERS = ("_load_all", "fetch_for_tag", "_load")


def evict(self, key):  # noqa: ANN001, ANN201
    names = [frame.name for frame in traceback.extract_stack(limit=14)]
    if any("kv" in name for name in names):
        COUNTS["room for KV"] += 1
    elif any(name in LOAD_CALLERS for name in names):
        COUNTS["an exact load in the forward"] += 1
    else:
        COUNTS["other: " + " > ".join(names[-6:-1])] += 1
    return _evict(self, key)


def evict_chosen(self, keys):  # noqa: ANN001, ANN201
    COUNTS["step-end actions"] += len(keys)
    return _evict_chosen(self, keys)


ExpertStore.evict, ExpertStore.evict_chosen = evict, evict_chosen
sys.argv = ["fallbackgate", *sys.argv[1:]]
try:  # as `python -m fallbackgate ...` would run
    runpy.run_module("fallbackgate", run_name="__main__", alter_sys=True)
finally:
    for name, count in COUNTS.most_common():
        print(f"{count:6d} {name}")

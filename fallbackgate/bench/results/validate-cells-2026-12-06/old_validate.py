"""OLD_VENV/bin/python old_validate.py POINTS_JSON OUT_JSON

The simulator before stop 48 (``deb403a`` installed alone in OLD_VENV: ``python3 -m venv OLD_VENV &&
OLD_VENV/bin/pip install torch==2.13.0 ./worktree-at-deb403a``) over the traces ``bench.validate_cells`` kept
(POINTS_JSON: its ``points.json``), waits fitted on each trace itself; rows to OUT_JSON, a summary printed."""

import json
import statistics
import sys

from fallbackgate.tracing.validate import validate

points = json.load(open(sys.argv[1]))
rows = []
for p in points:
    r = validate(p["trace"])
    rows.append(
        {k: p[k] for k in ("controller", "workload", "seed", "ram_frac", "kv_share")}
        | {k: r[k] for k in ("stall_error", "tpot_error", "stall_within", "tpot_within", "within_bound")}
    )
json.dump(rows, open(sys.argv[2], "w"), indent=1)
for c in ["all", "independent_lru", "joint", "static_split"]:
    g = [r for r in rows if c == "all" or r["controller"] == c]
    print(
        c,
        len(g),
        "within",
        sum(r["within_bound"] for r in g),
        "stall",
        sum(r["stall_within"] for r in g),
        "tpot",
        sum(r["tpot_within"] for r in g),
        "stall err median %+.1f%%" % (100 * statistics.median(r["stall_error"] for r in g)),
        "tpot err median %+.1f%%" % (100 * statistics.median(r["tpot_error"] for r in g)),
    )

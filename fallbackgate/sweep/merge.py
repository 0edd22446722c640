"""One sweep from several runs of the same grid on disjoint seeds, so verdicts rest on more seeds.

    python -m fallbackgate.sweep.merge seeds0-9/sweep.json seeds10-19/sweep.json --out merged/sweep.json

Each seed's comparison is made inside its own sweep (joint against partners of the same seed, the same SLO
targets), so seeds from sweeps run one after another may be pooled; what may not differ is the grid: the
model, workloads, requests, answer lengths, time scale, RAM fractions, KV shares, controllers, SLO scale,
step time and held-out seed must agree, and no seed may appear twice. Nothing here can tell the code a sweep ran
(the sources' commands and SLO references are kept: ``command``, ``slo_references_by_source``). The sources must
have been recorded in one ledger (no run id twice), so :mod:`fallbackgate.sweep.anatomy` can read the merged
file back; their own ``anatomy`` is not carried over (rerun it on the merged file).
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any

from fallbackgate.sweep.plot import regime_heatmaps
from fallbackgate.sweep.summary import markdown_table, summarise, summary_lines, with_budget_fields

GRID_KEYS = ("model_dir", "workloads", "num_requests", "mixed_requests", "max_new_tokens", "max_model_len",
             "time_scale", "ram_fracs", "kv_shares", "controllers", "slo_scale", "step_time", "held_out_seed",
             "is_equivalent_allowed", "audit_rate")  # fmt: skip
"""Config fields every merged sweep must share."""
POLICY_KEYS = {"expert_admission": "exact", "class_budgets": None, "max_num_seqs": 8}
"""Policy fields every merged sweep must share too, with the value a sweep written before them ran with (an
earlier part's SLO targets may serve a sweep with others: ``sweep --slo-from``)."""


class MergeError(ValueError):
    """The sweeps cannot be pooled; the message names the field or seed that differs."""


def merge(results: list[dict[str, Any]], sources: list[str]) -> dict[str, Any]:
    """The pooled result: every point, the first source's config with all seeds, and a fresh summary."""
    if len(results) < 2:
        raise MergeError("give at least two sweeps to merge")
    first = results[0]["config"]
    seen: dict[int, str] = {}  # seed -> its source
    run_sources: dict[int, str] = {}  # ledger run id -> its source
    for result, source in zip(results, sources, strict=True):
        config = result["config"]
        for key in GRID_KEYS:
            if config.get(key) != first.get(key):
                raise MergeError(f"{source}: config {key!r} is {config.get(key)!r}, not {first.get(key)!r}")
        for key, default in POLICY_KEYS.items():
            if config.get(key, default) != first.get(key, default):
                raise MergeError(f"{source}: config {key!r} is {config.get(key, default)!r}, not "
                                 f"{first.get(key, default)!r}")  # fmt: skip
        if (config.get("ram_basis") is None) != (first.get("ram_basis") is None):
            raise MergeError(f"{source}: its RAM budgets are fractions of another sweep's demand and the first "
                             "source's are not, or the other way round (sweep --ram-basis-from)")  # fmt: skip
        for seed in config["seeds"]:
            if seed in seen:
                raise MergeError(f"seed {seed} is in both {seen[seed]} and {source}")
            seen[seed] = source
        for point in result["points"]:
            if point["run_id"] in run_sources:
                raise MergeError(f"run {point['run_id']} is in both {run_sources[point['run_id']]} and {source}: "
                                 "sweeps recorded in different ledgers cannot be read back together")  # fmt: skip
            run_sources[point["run_id"]] = source
    points = with_budget_fields([p for r in results for p in r["points"]])
    bases = [r["config"].get("ram_basis") for r in results]
    basis = None if bases[0] is None else {k: v for b in bases for k, v in b.items()}
    return {
        "points": points,
        "config": {**first, "seeds": sorted(seen), "ram_basis": basis},
        "sources": sources,
        "slo_references_by_source": {s: r.get("slo_references") for r, s in zip(results, sources, strict=True)},
        "elapsed_s": sum(r.get("elapsed_s", 0.0) for r in results),
        "command": [r.get("command") for r in results],
        "summary": summarise(points, first["held_out_seed"]),
    }


def main(argv: list[str] | None = None) -> int:
    """Write the merged sweep.json and its heatmaps; print the summary and the README table."""
    parser = argparse.ArgumentParser(prog="python -m fallbackgate.sweep.merge", description=__doc__.split("\n")[0])
    parser.add_argument("sweeps", nargs="+", type=pathlib.Path, help="sweep.json files of the same grid")
    parser.add_argument("--out", type=pathlib.Path, required=True, help="the merged sweep.json to write")
    args = parser.parse_args(argv)
    try:
        merged = merge([json.loads(p.read_text()) for p in args.sweeps], [str(p) for p in args.sweeps])
    except (OSError, ValueError, KeyError) as exc:
        parser.exit(2, f"python -m fallbackgate.sweep.merge: error: {exc}\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(merged, indent=1) + "\n")
    regime_heatmaps(merged["points"], args.out.parent)
    print("\n".join(summary_lines(merged["summary"])))
    print(markdown_table(merged["summary"]))
    print(f"anatomy: python -m fallbackgate.sweep.anatomy {args.out} --ledger <the sources' ledger>")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

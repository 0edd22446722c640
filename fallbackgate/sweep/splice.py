"""A sweep with some controllers' points replaced by a rerun of those controllers against the same targets.

    fallbackgate sweep ... --controllers joint --slo-from seeds0-9/sweep.json --out seeds0-9-joint
    python -m fallbackgate.sweep.splice seeds0-9/sweep.json seeds0-9-joint/sweep.json --out spliced/sweep.json

For a change that only one controller's runs can see (the others' code paths untouched), rerunning that
controller alone keeps every comparison inside a seed and a target: the rerun must share the base's grid (bar
its controllers), its seeds and workloads, and its SLO targets (``--slo-from`` the base: every kind's
reference marked ``reused`` with the base's targets). Each rerun point replaces the base point of the same
workload, seed, RAM fraction, controller and KV share, and every base point of the rerun's controllers must be
replaced. Both must have been recorded in one ledger (no run id twice), so the anatomy can read the result
back. The result says what was spliced (``spliced``: source, controllers, command, elapsed seconds); its own
``anatomy`` is not carried over (rerun :mod:`fallbackgate.sweep.anatomy` on it).
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any

from fallbackgate.sweep.merge import GRID_KEYS, MergeError
from fallbackgate.sweep.plot import regime_heatmaps
from fallbackgate.sweep.summary import markdown_table, summarise, summary_lines, with_budget_fields


def _cell(point: dict[str, Any]) -> tuple[Any, ...]:
    return point["workload"], point["seed"], point["ram_frac"], point["controller"], point["kv_share"]


def _check_targets(base: dict[str, Any], rerun: dict[str, Any], rerun_source: str) -> None:
    for kind, theirs in base["slo_references"].items():
        mine = rerun.get("slo_references", {}).get(kind, {})
        if not mine.get("reused") or any(mine.get(k) != theirs.get(k) for k in ("slo_tpot_ms", "slo_ttft_ms")):
            raise MergeError(f"{rerun_source}: its {kind} SLO targets are not the base's (run it with --slo-from)")


def splice(base: dict[str, Any], rerun: dict[str, Any], base_source: str, rerun_source: str) -> dict[str, Any]:
    """`base` with the points of `rerun`'s controllers replaced by `rerun`'s, and a fresh summary."""
    config, theirs = base["config"], rerun["config"]
    for key in (*GRID_KEYS, "seeds"):
        if key != "controllers" and theirs.get(key) != config.get(key):
            raise MergeError(f"{rerun_source}: config {key!r} is {theirs.get(key)!r}, not {config.get(key)!r}")
    controllers = list(theirs["controllers"])
    if not set(controllers) <= set(config["controllers"]):
        raise MergeError(f"{rerun_source}: controllers {controllers} are not all in {base_source}")
    _check_targets(base, rerun, rerun_source)
    replaced = {_cell(p): p for p in base["points"] if p["controller"] in controllers}
    new = {_cell(p): p for p in rerun["points"]}
    if set(new) != set(replaced):
        missing, extra = sorted(set(replaced) - set(new), key=str), sorted(set(new) - set(replaced), key=str)
        raise MergeError(f"{rerun_source}: cells missing {missing[:3]} / not in the base {extra[:3]}")
    kept = [p for p in base["points"] if p["controller"] not in controllers]
    clash = {p["run_id"] for p in kept} & {p["run_id"] for p in new.values()}
    if clash:
        raise MergeError(f"run {min(clash)} is in both {base_source} and {rerun_source}: record both in one ledger")
    points = with_budget_fields(kept + [new[_cell(p)] for p in base["points"] if _cell(p) in new])
    spliced = {"source": rerun_source, "controllers": controllers, "command": rerun.get("command"),
               "elapsed_s": rerun.get("elapsed_s", 0.0)}  # fmt: skip
    out = {k: v for k, v in base.items() if k not in ("anatomy", "summary", "points")}
    return {**out, "points": points, "spliced": [*base.get("spliced", []), spliced],
            "summary": summarise(points, config["held_out_seed"])}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Write the spliced sweep.json and its heatmaps; print the summary and the README table."""
    parser = argparse.ArgumentParser(prog="python -m fallbackgate.sweep.splice", description=__doc__.split("\n")[0])
    parser.add_argument("base", type=pathlib.Path, help="the sweep.json whose points are replaced")
    parser.add_argument("rerun", type=pathlib.Path, help="the rerun's sweep.json (--slo-from the base)")
    parser.add_argument("--out", type=pathlib.Path, required=True, help="the spliced sweep.json to write")
    args = parser.parse_args(argv)
    try:
        base, rerun = (json.loads(p.read_text()) for p in (args.base, args.rerun))
        result = splice(base, rerun, str(args.base), str(args.rerun))
    except (OSError, ValueError, KeyError) as exc:
        parser.exit(2, f"python -m fallbackgate.sweep.splice: error: {exc}\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    regime_heatmaps(result["points"], args.out.parent)
    print("\n".join(summary_lines(result["summary"])))
    print(markdown_table(result["summary"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

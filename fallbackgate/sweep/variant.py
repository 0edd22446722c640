"""Joint under another policy against the same baselines: one sweep's partners, another sweep's joint runs.

    python -m fallbackgate.sweep.variant BASE/sweep.json VARIANT/sweep.json --out DIR/sweep.json

``VARIANT`` is a sweep of BASE's grid on BASE's seeds against the same SLO targets (``sweep --slo-from``) that
ran ``--controllers joint`` only, typically with another ``--expert-admission`` or ``--class-budgets``. The
result keeps BASE's static splits and two LRUs, puts VARIANT's joint runs in place of BASE's, and recomputes
the summary, so its verdicts are that joint's against the same partners — at that joint's audited quality,
which ``joint_quality`` puts beside, per cell, with BASE's own joint: mean and worst mean KL, worst p99 KL,
lowest top-1 agreement, low-bit experts served, gates passed, and the variant's paired gain over BASE's joint.
The two sweeps ran at different times: run them interleaved (seed by seed, or in parts) and read BASE's own
summary beside this one. Nothing is written when the grids, seeds or SLO targets differ.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
from typing import Any

from fallbackgate.sweep.intervals import interval
from fallbackgate.sweep.merge import GRID_KEYS, POLICY_KEYS
from fallbackgate.sweep.summary import (
    JOINT,
    VERDICT_METRICS,
    gain,
    markdown_table,
    summarise,
    summary_lines,
    with_budget_fields,
)

TARGET_KEYS = ("slo_tpot_ms", "slo_ttft_ms")  # what "the same SLO targets" compares per workload
Cell = tuple[str, float, int]  # workload, RAM fraction, seed


class VariantError(ValueError):
    """The two sweeps cannot be compared; the message names what differs."""


def _targets(result: dict[str, Any], source: str) -> dict[str, dict[str, Any]]:
    """Per workload the SLO targets a sweep ran against (a merged sweep's sources must agree)."""
    by_source = result.get("slo_references_by_source") or {source: result.get("slo_references") or {}}
    seen = [{w: {k: ref.get(k) for k in TARGET_KEYS} for w, ref in (refs or {}).items()} for refs in by_source.values()]
    if any(targets != seen[0] for targets in seen):
        raise VariantError(f"{source}: its parts ran against different SLO targets")
    return seen[0]


def _joint_runs(result: dict[str, Any], source: str) -> dict[Cell, dict[str, Any]]:
    runs: dict[Cell, dict[str, Any]] = {}
    for point in result["points"]:
        if point["controller"] == JOINT:
            cell = (point["workload"], point["ram_frac"], point["seed"])
            if cell in runs:
                raise VariantError(f"{source}: joint ran twice for {cell}")
            runs[cell] = point
    return runs


def _check(base: dict[str, Any], variant: dict[str, Any], sources: tuple[str, str]) -> None:
    b, v = base["config"], variant["config"]
    for key in (*GRID_KEYS, "seeds"):
        if key != "controllers" and b.get(key) != v.get(key):
            raise VariantError(f"{sources[1]}: config {key!r} is {v.get(key)!r}, not {b.get(key)!r}")
    if v.get("controllers") != [JOINT]:
        raise VariantError(f"{sources[1]}: ran {v.get('controllers')!r}; a variant runs --controllers joint only")
    base_targets, variant_targets = _targets(base, sources[0]), _targets(variant, sources[1])
    for workload in b["workloads"]:
        if base_targets.get(workload) != variant_targets.get(workload):
            raise VariantError(f"{sources[1]}: SLO targets of {workload} are {variant_targets.get(workload)}, not "
                               f"{base_targets.get(workload)} (run it with sweep --slo-from)")  # fmt: skip
    run_ids = {p["run_id"] for p in base["points"]}
    clash = sorted(run_ids & {p["run_id"] for p in variant["points"]})
    if clash:
        raise VariantError(f"run {clash[0]} is in both sweeps: record them in one ledger")


def joint_quality(base_runs: dict[Cell, dict[str, Any]], variant_runs: dict[Cell, dict[str, Any]]) -> dict[str, Any]:
    """Per workload @ RAM: both joints' audited quality, and the variant's paired gain over BASE's joint."""
    out: dict[str, Any] = {}
    for workload, ram in sorted({(w, r) for w, r, _ in base_runs}):
        seeds = sorted(s for w, r, s in base_runs if (w, r) == (workload, ram))
        pairs = [(base_runs[(workload, ram, s)]["metrics"], variant_runs[(workload, ram, s)]["metrics"]) for s in seeds]
        row: dict[str, Any] = {}
        for label, runs in (("base", [b for b, _ in pairs]), ("variant", [v for _, v in pairs])):
            row[label] = {
                "mean_kl": statistics.fmean(m.get("mean_kl", 0.0) for m in runs),
                "worst_mean_kl": max(m.get("mean_kl", 0.0) for m in runs),
                "worst_p99_kl": max(m.get("max_p99_kl", 0.0) for m in runs),
                "min_top1_agreement": min(m.get("top1_agreement", 1.0) for m in runs),
                "lowbit_experts": sum(m.get("count_expert_expert_lowbit", 0.0) for m in runs),
                "gates_passed": sum(m.get("gate_passed", 0.0) for m in runs),
                "runs": len(runs),
            }
        row["variant_gain_over_base"] = {
            metric: interval([gain(metric, v[metric], b[metric]) for b, v in pairs]) for metric in VERDICT_METRICS
        }
        out[f"{workload}@{ram}"] = row
    return out


def combine(base: dict[str, Any], variant: dict[str, Any], sources: tuple[str, str]) -> dict[str, Any]:
    """BASE's partners with VARIANT's joint runs, the summary recomputed, both joints' quality beside."""
    _check(base, variant, sources)
    base_runs, variant_runs = _joint_runs(base, sources[0]), _joint_runs(variant, sources[1])
    if set(base_runs) != set(variant_runs):
        missing = sorted(set(base_runs) ^ set(variant_runs), key=str)[0]
        raise VariantError(f"joint's run for {missing} is in one sweep only")
    partners = [p for p in base["points"] if p["controller"] != JOINT]
    points = with_budget_fields(partners + list(variant_runs.values()))
    policy = {key: variant["config"].get(key, default) for key, default in POLICY_KEYS.items()}
    by_source = base.get("slo_references_by_source") or {}
    return {
        "points": points,
        "config": {**base["config"], **policy, "joint_from": sources[1]},
        "sources": {"partners": sources[0], "joint": sources[1]},
        "slo_references": base.get("slo_references") or next(iter(by_source.values()), None),
        "command": {"partners": base.get("command"), "joint": variant.get("command")},
        "summary": summarise(points, base["config"]["held_out_seed"]),
        "joint_quality": joint_quality(base_runs, variant_runs),
    }


def quality_lines(quality: dict[str, Any]) -> list[str]:
    """One line per cell: both joints' quality and the variant's gain over BASE's joint."""
    lines = []
    for key, row in quality.items():
        b, v, g = row["base"], row["variant"], row["variant_gain_over_base"]
        gains = "  ".join(
            f"{m} {100 * g[m]['mean']:+.1f} % [{100 * g[m]['lo']:+.1f}, {100 * g[m]['hi']:+.1f}]" for m in g
        )
        lines.append(
            f"{key:22s} KL {b['mean_kl']:.1e} -> {v['mean_kl']:.1e} (worst {v['worst_mean_kl']:.1e}), top-1 >= "
            f"{v['min_top1_agreement']:.3f}, low-bit {b['lowbit_experts']:.0f} -> {v['lowbit_experts']:.0f}, gates "
            f"{v['gates_passed']:.0f}/{v['runs']}; variant vs base joint: {gains}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    """Write the combined sweep.json; print its summary, the README table and both joints' quality."""
    parser = argparse.ArgumentParser(prog="python -m fallbackgate.sweep.variant", description=__doc__.split("\n")[0])
    parser.add_argument("base", type=pathlib.Path, help="sweep.json with the partners (and a joint of its own)")
    parser.add_argument("variant", type=pathlib.Path, help="sweep.json of joint alone, same grid, seeds and targets")
    parser.add_argument("--out", type=pathlib.Path, required=True, help="the combined sweep.json to write")
    args = parser.parse_args(argv)
    try:
        result = combine(json.loads(args.base.read_text()), json.loads(args.variant.read_text()),
                         (str(args.base), str(args.variant)))  # fmt: skip
    except (OSError, ValueError, KeyError) as exc:
        parser.exit(2, f"python -m fallbackgate.sweep.variant: error: {exc}\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("\n".join(summary_lines(result["summary"])))
    print(markdown_table(result["summary"]))
    print("\n".join(quality_lines(result["joint_quality"])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

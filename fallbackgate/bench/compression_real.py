"""python -m fallbackgate.bench.compression_real --condition NAME=SWEEP_JSON[,SWEEP_JSON...] ... [--base NAME]
    [--json FILE] [--png FILE]

Does model-side compression shrink or grow the value of joint management? (PROBE.md, "also raised"), measured in
the engine rather than simulated (``bench.compression_value``): each condition is a sweep of every controller —
e.g. the bundled fp32 model, its bf16 copy (``python -m fallbackgate.synth.cast``), or the copy serving more
requests in the fp32 runs' RAM bytes (``sweep --ram-basis-from``) — given as its parts (sweeps of one grid on
disjoint seeds, pooled as ``sweep.merge`` pools them).

Per condition and cell (workload@RAM fraction): the RAM bytes against the condition's own demand (all routed
experts plus the KV every request would hold at full length; a cell whose RAM holds all of it is marked not
binding); each condition's SLO targets (its own all-in-RAM reference); joint's gains over the chosen and the
per-seed oracle static split and over two LRUs in SLO attainment, P99 TPOT and stall (the sweep summary's,
Student-t 95 % over seeds); joint's stall saving pooled over the seeds (1 − Σ joint / Σ partner) against each
seed's least-stalling static split and two LRUs, as ``bench.compression_value`` reports it; the audited mean KL
of joint and of the baselines (each against its own model's exact baseline: a bf16 model's floor is its own).

Against ``--base`` (default: the first condition), each cell is compared with the base's cell of the **same
pressure** (the same fraction of its own demand) and with the base's cell of the **same bytes** (the same RAM,
seed by seed): the change of joint's gains in points, paired seed by seed where the two conditions serve the
same requests (same workload settings), else the difference of the means (Welch). JSON out; ``--png`` draws
joint's gains per condition.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

from fallbackgate.bench import write_results
from fallbackgate.sweep.intervals import interval, welch_interval
from fallbackgate.sweep.merge import merge
from fallbackgate.sweep.summary import INDEPENDENT, JOINT, STATIC, summarise, with_budget_fields

PARTNERS = ("chosen_static", "oracle_static", INDEPENDENT)
METRICS = ("slo_attainment", "tpot_p99_ms", "stall_s")
POOLED = ("least-stall static", "two LRUs")  # pooled stall saving's partners
REQUEST_KEYS = ("workloads", "num_requests", "mixed_requests", "max_new_tokens", "max_model_len", "time_scale")
"""Config fields that, with the seed, decide a sweep's requests: conditions equal on them are paired by seed."""


def load_condition_results(results: list[dict[str, Any]], sources: list[str] | None = None) -> dict[str, Any]:
    """One condition's points, config, SLO references and summary: one sweep as it is, several pooled
    (``sweep.merge``'s checks)."""
    if len(results) > 1:
        merged = merge(results, sources or [f"part {i + 1}" for i in range(len(results))])
        return {**merged, "slo_references": results[0].get("slo_references", {})}
    points = with_budget_fields(results[0]["points"])
    return {**results[0], "points": points, "summary": summarise(points, results[0]["config"]["held_out_seed"])}


def seed_rows(points: list[dict[str, Any]]) -> dict[str, dict[int, dict[str, float]]]:
    """Per cell (as the sweep summary keys it) and seed: stall of joint, of the least-stalling static split and of
    two LRUs; RAM and demand bytes; joint's and the baselines' largest audited mean KL; gates passed."""
    cells: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for p in points:
        cells.setdefault(f"{p['workload']}@{p['ram_frac']}", {}).setdefault(p["seed"], []).append(p)
    out: dict[str, dict[int, dict[str, float]]] = {}
    for name, by_seed in cells.items():
        for seed, runs in by_seed.items():
            joint = next((r for r in runs if r["controller"] == JOINT), None)
            lru = next((r for r in runs if r["controller"] == INDEPENDENT), None)
            statics = [r["metrics"]["stall_s"] for r in runs if r["controller"] == STATIC]
            if joint is None or lru is None or not statics:
                continue
            out.setdefault(name, {})[seed] = {
                JOINT: joint["metrics"]["stall_s"], POOLED[0]: min(statics), POOLED[1]: lru["metrics"]["stall_s"],
                "ram_bytes": float(joint["ram_bytes"]), "demand_bytes": float(joint["demand_bytes"]),
                "joint_mean_kl": joint["metrics"]["mean_kl"],
                "baseline_max_mean_kl": max(r["metrics"]["mean_kl"] for r in runs if r["controller"] != JOINT),
                "gates_passed": float(sum(bool(r["metrics"]["gate_passed"]) for r in runs)),
                "runs": float(len(runs)),
            }  # fmt: skip
    return out


def _mean(rows: list[dict[str, float]], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def cell_summary(comparison: dict[str, Any], by_seed: dict[int, dict[str, float]]) -> dict[str, Any]:
    """One condition's cell: budget, gains (with their per-seed values), pooled stall savings, quality."""
    rows = list(by_seed.values())
    gains = comparison["gains"]
    return {
        "n": len(rows),
        "ram_bytes": _mean(rows, "ram_bytes"),
        "ram_bytes_by_seed": {s: r["ram_bytes"] for s, r in by_seed.items()},
        "demand_bytes": _mean(rows, "demand_bytes"),
        "ram_of_demand": sum(r["ram_bytes"] / r["demand_bytes"] for r in rows) / len(rows),
        "is_binding": all(r["ram_bytes"] < r["demand_bytes"] for r in rows),
        "chosen_static_kv_share": comparison["chosen_static_kv_share"],
        "gains": {p: {m: gains[p][m]["all"] for m in METRICS if m in gains.get(p, {})} for p in PARTNERS},
        "gains_by_seed": {p: {m: gains[p][m]["per_seed"] for m in METRICS if m in gains.get(p, {})} for p in PARTNERS},
        "stall_s": {k: _mean(rows, k) for k in (JOINT, *POOLED)},
        "pooled_stall_saving": {
            k: 1 - sum(r[JOINT] for r in rows) / sum(r[k] for r in rows)
            if sum(r[k] for r in rows) > 0
            else float("nan")
            for k in POOLED
        },
        "joint_mean_kl": _mean(rows, "joint_mean_kl"),
        "joint_max_mean_kl": max(r["joint_mean_kl"] for r in rows),
        "baseline_max_mean_kl": _mean(rows, "baseline_max_mean_kl"),
        "gates_passed": int(sum(r["gates_passed"] for r in rows)),
        "runs": int(sum(r["runs"] for r in rows)),
    }


def gain_changes(mine: dict[str, Any], theirs: dict[str, Any], is_paired: bool) -> dict[str, Any]:
    """Per partner and metric, joint's gain in `mine` minus in `theirs` (fractions: points / 100): paired over
    their common seeds, or (not paired) the difference of the means with Welch's interval."""
    out: dict[str, Any] = {"is_paired": is_paired}
    for partner in PARTNERS:
        for metric in METRICS:
            a = mine["gains_by_seed"].get(partner, {}).get(metric, {})
            b = theirs["gains_by_seed"].get(partner, {}).get(metric, {})
            common = sorted(set(a) & set(b))
            if is_paired and common:
                out.setdefault(partner, {})[metric] = interval([a[s] - b[s] for s in common])
            elif not is_paired and a and b:
                out.setdefault(partner, {})[metric] = welch_interval(list(a.values()), list(b.values()))
    return out


def _same_bytes(mine: dict[str, Any], theirs: dict[str, Any]) -> bool:
    common = set(mine["ram_bytes_by_seed"]) & set(theirs["ram_bytes_by_seed"])
    return bool(common) and all(
        abs(mine["ram_bytes_by_seed"][s] - theirs["ram_bytes_by_seed"][s]) <= 1e-3 * theirs["ram_bytes_by_seed"][s]
        for s in common
    )


def partners_in_base(entry: dict[str, Any], base: dict[str, dict[str, Any]]) -> dict[str, str]:
    """The base's cells of the same pressure (fraction of own demand) and of the same RAM bytes as `entry`."""
    out = {}
    for name, theirs in sorted(base.items()):
        if abs(theirs["ram_of_demand"] - entry["ram_of_demand"]) < 0.01 and "same pressure" not in out:
            out["same pressure"] = name
        if _same_bytes(entry, theirs) and "same bytes" not in out:
            out["same bytes"] = name
    return out


def summarize(conditions: dict[str, dict[str, Any]], base: str) -> dict[str, Any]:
    """Per condition: its SLO targets and, per cell, :func:`cell_summary` and the changes against the base's
    cells of the same pressure and the same bytes."""
    cells = {name: {cell: cell_summary(comparison, seed_rows(cond["points"])[cell])
                    for cell, comparison in sorted(cond["summary"]["comparisons"].items())}
             for name, cond in conditions.items()}  # fmt: skip
    keys = {name: [cond["config"].get(k) for k in REQUEST_KEYS] for name, cond in conditions.items()}
    out: dict[str, Any] = {}
    for name, by_cell in cells.items():
        for entry in by_cell.values():
            if name == base:
                continue
            entry["vs_base"] = {
                kind: {"base_cell": cell, **gain_changes(entry, cells[base][cell], keys[name] == keys[base])}
                for kind, cell in partners_in_base(entry, cells[base]).items()
            }
        targets = {w: {k: ref.get(k) for k in ("slo_tpot_ms", "slo_ttft_ms")}
                   for w, ref in conditions[name].get("slo_references", {}).items()}  # fmt: skip
        out[name] = {"slo_targets": targets, "cells": by_cell}
    return out


def _points(iv: dict[str, float]) -> str:
    return f"{100 * iv['mean']:+.1f} [{100 * iv['lo']:+.1f}, {100 * iv['hi']:+.1f}]"


def report_lines(summary: dict[str, Any], base: str) -> list[str]:
    """Per condition: SLO targets; per cell its budget, joint's gains (P99 TPOT, SLO attainment), pooled stall
    saving, quality; and the changes against the base (points)."""
    lines = []
    for name, cond in summary.items():
        targets = "; ".join(f"{w}: TPOT {t['slo_tpot_ms'][0]:.1f} / TTFT {t['slo_ttft_ms'][0]:.1f} ms"
                            for w, t in cond["slo_targets"].items() if t.get("slo_tpot_ms"))  # fmt: skip
        lines.append(f"{name} (strict SLO targets from its own all-in-RAM run: {targets})")
        for cell, e in cond["cells"].items():
            g = e["gains"]
            binding = "" if e["is_binding"] else ", NOT BINDING"
            lines.append(f"  {cell}: RAM {e['ram_bytes'] / 2**20:.2f} MiB, {e['ram_of_demand']:.2f} of its demand"
                         f"{binding}; chosen static KV {e['chosen_static_kv_share']}")  # fmt: skip
            for metric, label in (("tpot_p99_ms", "P99 TPOT"), ("slo_attainment", "SLO attainment"),
                                  ("stall_s", "stall")):  # fmt: skip
                row = " / ".join(_points(g[p][metric]) for p in ("oracle_static", "chosen_static", INDEPENDENT))
                lines.append(f"    joint's {label} gain, % over oracle static / chosen static / two LRUs: {row}")
            pooled = " / ".join(f"{100 * e['pooled_stall_saving'][k]:+.1f} %" for k in POOLED)
            lines.append(f"    pooled stall saving over the least-stall split / two LRUs: {pooled}; stall s joint "
                         f"{e['stall_s'][JOINT]:.3f}, least-stall split {e['stall_s'][POOLED[0]]:.3f}, two LRUs "
                         f"{e['stall_s'][POOLED[1]]:.3f}")  # fmt: skip
            lines.append(
                f"    mean KL joint {e['joint_mean_kl']:.2e} (worst run {e['joint_max_mean_kl']:.2e}), "
                f"baselines {e['baseline_max_mean_kl']:.2e}; gates passed {e['gates_passed']}/{e['runs']}"
            )
            for kind, change in e.get("vs_base", {}).items():
                how = "paired by seed" if change["is_paired"] else "difference of means, Welch"
                moved = "; ".join(f"{m} {_points(change[p][m])}" for p in ("oracle_static", INDEPENDENT)
                                  for m in ("tpot_p99_ms", "stall_s") if m in change.get(p, {}))  # fmt: skip
                lines.append(f"    vs {base} {change['base_cell']} ({kind}, {how}), points, over oracle static then "
                             f"two LRUs: {moved}")  # fmt: skip
    return lines


def plot_gains(summary: dict[str, Any], path: str) -> None:
    """Joint's gain over the oracle static split and two LRUs per condition and cell: P99 TPOT, SLO attainment
    and stall (rows), with 95 % intervals; cells whose RAM is not binding are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(f"{n}\n{c}", e) for n, cond in summary.items() for c, e in cond["cells"].items() if e["is_binding"]]
    fig, axes = plt.subplots(len(METRICS), 1, figsize=(max(6, 1.3 * len(bars)), 3.2 * len(METRICS)), squeeze=False)
    for row, metric in enumerate(METRICS):
        ax = axes[row][0]
        for i, partner in enumerate(("oracle_static", INDEPENDENT)):
            ivs = [e["gains"][partner][metric] for _, e in bars]
            errors = [[100 * (iv["mean"] - iv["lo"]) for iv in ivs], [100 * (iv["hi"] - iv["mean"]) for iv in ivs]]
            ax.bar([x + 0.4 * i for x in range(len(bars))], [100 * iv["mean"] for iv in ivs], 0.4, yerr=errors,
                   label=f"vs {partner.replace('_', ' ')}")  # fmt: skip
        ax.axhline(0, color="black", linewidth=0.5)
        ax.set_xticks([x + 0.2 for x in range(len(bars))], [label for label, _ in bars], fontsize=8)
        ax.set_title(f"joint's {metric} gain (measured, 95 % over seeds)", fontsize=9)
        ax.set_ylabel("%")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _condition(text: str) -> tuple[str, list[pathlib.Path]]:
    name, sep, paths = text.partition("=")
    if not sep or not name or not paths:
        raise argparse.ArgumentTypeError(f"expected NAME=SWEEP_JSON[,SWEEP_JSON...], got {text!r}")
    return name, [pathlib.Path(p) for p in paths.split(",") if p]


def main(argv: list[str] | None = None) -> None:
    """Read the conditions' sweeps, print the comparison, write the JSON and the figure."""
    p = argparse.ArgumentParser(prog="python -m fallbackgate.bench.compression_real",
                                description=__doc__.split("\n\n")[1])  # fmt: skip
    p.add_argument("--condition", type=_condition, action="append", required=True,
                   help="NAME=SWEEP_JSON[,...]: one condition's sweep parts (repeat per condition)")  # fmt: skip
    p.add_argument("--base", default=None, help="the condition the others are compared with (default: the first)")
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None, help="figure: joint's gains per condition")
    args = p.parse_args(argv)
    names = [n for n, _ in args.condition]
    base = args.base or names[0]
    if base not in names or len(set(names)) != len(names):
        sys.exit(f"compression_real: --base {base!r} must name one of the conditions {names}, each named once")
    try:
        conditions = {n: load_condition_results([json.loads(x.read_text()) for x in paths], [str(x) for x in paths])
                      for n, paths in args.condition}  # fmt: skip
    except (OSError, ValueError, KeyError) as exc:
        sys.exit(f"compression_real: {exc}")
    summary = summarize(conditions, base)
    print("\n".join(report_lines(summary, base)))
    if args.json:
        write_results(args.json, base=base, summary=summary,
                      sources={n: [str(x) for x in paths] for n, paths in args.condition})  # fmt: skip
    if args.png:
        plot_gains(summary, args.png)


if __name__ == "__main__":
    main()

"""Two sweeps' gains for joint compared cell by cell, so a claim that one pool of seeds "decides less" or "gains
less" than another has an interval.

    python -m fallbackgate.sweep.pools fallbackgate/sweep_results/rotated20/sweep.json \\
        fallbackgate/sweep_results/sweep.json [--partners independent_lru,chosen_static] [--json OUT]

For every (workload, RAM) cell in both summaries, partner and verdict metric: joint's per-seed gains in the
first sweep minus those in the second (the summaries' ``per_seed`` gains × 100: points of relative gain, or of
SLO attainment where a partner met none), with a Welch 95 % interval (the seeds differ, so nothing is paired).
Each sweep's ``chosen_static`` is its own (its non-held-out seeds chose it). Then, per partner and metric, the
mean of the cells' differences (a cell with fewer than two seeds on a side has no interval: left out, and
counted) and the cells whose interval lies wholly above or below 0. Two sweeps with no cell comparing joint
with the partners asked for are an error. What made the two sweeps differ (machine, order, code) is not known
here: say it beside the numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
from typing import Any

from fallbackgate.sweep.intervals import welch_interval
from fallbackgate.sweep.summary import INDEPENDENT, VERDICT_METRICS

PARTNERS = (INDEPENDENT, "chosen_static", "oracle_static")


def cell_differences(first: dict[str, Any], second: dict[str, Any], partners: tuple[str, ...]) -> dict[str, Any]:
    """Per cell (``workload@ram``), partner and metric: first's gains minus second's, in points, Welch 95 %."""
    a, b = first["comparisons"], second["comparisons"]
    common = sorted(set(a) & set(b))
    if not common:
        raise ValueError("the two sweeps share no (workload, RAM) cell")
    out: dict[str, Any] = {}
    for cell in common:
        for partner in partners:
            for metric in VERDICT_METRICS:
                ga = a[cell]["gains"].get(partner, {}).get(metric)
                gb = b[cell]["gains"].get(partner, {}).get(metric)
                if ga is None or gb is None:
                    continue
                diff = welch_interval([100 * v for v in ga["per_seed"].values()],
                                      [100 * v for v in gb["per_seed"].values()])  # fmt: skip
                diff["n_first"], diff["n_second"] = len(ga["per_seed"]), len(gb["per_seed"])
                out.setdefault(cell, {}).setdefault(partner, {})[metric] = diff
    if not out:
        raise ValueError(f"no cell of both sweeps compares joint with {', '.join(partners)}")
    return out


def overall(cells: dict[str, Any]) -> dict[str, Any]:
    """Per partner and metric: the mean of the cells' differences, and the cells above and below 0."""
    out: dict[str, Any] = {}
    for cell, by_partner in cells.items():
        for partner, by_metric in by_partner.items():
            for metric, d in by_metric.items():
                o = out.setdefault(partner, {}).setdefault(
                    metric, {"means": [], "above": [], "below": [], "num_without_interval": 0}
                )
                if not math.isfinite(d["lo"]):
                    o["num_without_interval"] += 1
                    continue
                o["means"].append(d["mean"])
                if d["lo"] > 0:
                    o["above"].append(cell)
                elif d["hi"] < 0:
                    o["below"].append(cell)
    for by_metric in out.values():
        for o in by_metric.values():
            means = o.pop("means")
            o["num_cells"] = len(means)
            o["mean_of_cells"] = statistics.fmean(means) if means else float("nan")
    return out


def lines(cells: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    """The report, a line per cell and partner, then a line per partner and metric."""
    text = []
    for cell, by_partner in cells.items():
        for partner, by_metric in by_partner.items():
            parts = [f"{m} {d['mean']:+.1f} [{d['lo']:+.1f}, {d['hi']:+.1f}]" for m, d in by_metric.items()]
            text.append(f"{cell:22s} vs {partner:15s} " + "; ".join(parts))
    for partner, by_metric in summary.items():
        for metric, o in by_metric.items():
            text.append(
                f"vs {partner} {metric}: mean over {o['num_cells']} cells {o['mean_of_cells']:+.1f} points; "
                f"above 0: {', '.join(o['above']) or 'none'}; below 0: {', '.join(o['below']) or 'none'}"
                + (f"; {o['num_without_interval']} cell(s) without an interval" if o["num_without_interval"] else "")
            )
    return text


def _summary(path: pathlib.Path) -> dict[str, Any]:
    result = json.loads(path.read_text())
    summary = result.get("summary") if isinstance(result, dict) else None
    if not isinstance(summary, dict) or "comparisons" not in summary:
        raise ValueError(f"{path}: no sweep summary (python -m fallbackgate.sweep.summary {path} writes one)")
    return summary


def main(argv: list[str] | None = None) -> int:
    """Print the comparison; ``--json`` also writes it."""
    p = argparse.ArgumentParser(prog="python -m fallbackgate.sweep.pools", description=__doc__.split("\n\n")[0])
    p.add_argument("first", type=pathlib.Path, help="a sweep.json (its summary)")
    p.add_argument("second", type=pathlib.Path, help="the sweep.json it is compared with")
    p.add_argument("--partners", default=",".join(PARTNERS[:2]), help=f"comma-separated, of {', '.join(PARTNERS)}")
    p.add_argument("--json", type=pathlib.Path, help="write the comparison here too")
    args = p.parse_args(argv)
    partners = tuple(x for x in args.partners.split(",") if x)
    unknown = [x for x in partners if x not in PARTNERS]
    if unknown or not partners:
        p.error(f"--partners: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(PARTNERS)}")
    try:
        first, second = (_summary(path) for path in (args.first, args.second))
        cells = cell_differences(first, second, partners)
    except (OSError, ValueError) as exc:
        p.exit(2, f"python -m fallbackgate.sweep.pools: error: {exc!s}\n")
    summary = overall(cells)
    print(f"# {args.first} minus {args.second}: joint's gain, points (Welch 95 %)")
    print("\n".join(lines(cells, summary)))
    if args.json:
        args.json.write_text(json.dumps({"cells": cells, "overall": summary}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

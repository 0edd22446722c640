"""``fallbackgate calibrate --ledger URL [--run ID ...]``: fit the cost predictor's per tag × layer scales.

For every audited request of the chosen runs (default: all), the measured KL summed over its positions
is compared with the predicted nats its approximate events carried, per tag and layer. Each request gives
the ratio measured / predicted; a (tag, layer) takes the ``--quantile`` (default 0.95) of the ratios of
the requests it appears in, weighted by its share of their prediction, so later predictions err high.
The new scale is the scale in force (newest calibration, else the default) times that ratio; it is
stored in the ``calibrations`` table, and later runs load it (:func:`fallbackgate.controllers.cost.load_calibration`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from sqlalchemy import func, select

from fallbackgate.controllers.cost import CALIBRATED_TAGS, load_calibration
from fallbackgate.engine.tags import Tag
from fallbackgate.ledger.db import DEFAULT_LEDGER, ENV_VAR, Ledger, LedgerError, open_ledger
from fallbackgate.ledger.models import EventRow, RequestStatRow
from fallbackgate.ledger.writer import LedgerWriter

MIN_SCALE = 1e-6  # a fitted scale never reaches 0: a tag that measured nothing still costs a little


def add_parser(subparsers: Any) -> None:
    """Register ``calibrate``."""
    p: argparse.ArgumentParser = subparsers.add_parser("calibrate", help="fit predicted-cost scales from a ledger")
    p.add_argument("--ledger", default=None, help=f"ledger URL (default: ${ENV_VAR}, else {DEFAULT_LEDGER})")
    p.add_argument("--run", type=int, action="append", default=[], help="runs to fit on (repeatable; default all)")
    p.add_argument("--quantile", type=float, default=0.95, help="quantile of per-request ratios (default 0.95)")
    p.add_argument("--dry-run", action="store_true", help="print the fit without storing it")
    p.set_defaults(func=run)


def request_samples(ledger: Ledger, run_ids: list[int]) -> list[dict[str, Any]]:
    """Per audited request: measured KL summed over positions and predicted nats per (tag, layer)."""
    ev = EventRow
    stmt = (
        select(ev.run_id, ev.request_id, ev.tag, ev.layer, func.sum(ev.predicted_cost).label("predicted"))
        .where(ev.exactness == "approximate", ev.predicted_cost > 0)
        .group_by(ev.run_id, ev.request_id, ev.tag, ev.layer)
    )
    stats = select(
        RequestStatRow.run_id, RequestStatRow.request_id, RequestStatRow.mean_kl, RequestStatRow.num_positions
    )
    if run_ids:
        stmt, stats = stmt.where(ev.run_id.in_(run_ids)), stats.where(RequestStatRow.run_id.in_(run_ids))
    samples: dict[tuple[int, str], dict[str, Any]] = {}
    with ledger.engine.connect() as conn:
        for run_id, request_id, mean_kl, num in conn.execute(stats):
            samples[(run_id, request_id)] = {"run_id": run_id, "measured": mean_kl * num, "predicted": {}}
        for run_id, request_id, tag, layer, predicted in conn.execute(stmt):
            if (run_id, request_id) in samples:
                samples[(run_id, request_id)]["predicted"][(tag, int(layer))] = float(predicted)
    return [s for s in samples.values() if s["predicted"]]


def weighted_quantile(values: list[float], weights: list[float], q: float) -> float:
    """The smallest value whose cumulative weight reaches `q` of the total."""
    pairs = sorted(zip(values, weights, strict=True))
    total = sum(weights)
    running = 0.0
    for value, weight in pairs:
        running += weight
        if running >= q * total - 1e-15:
            return value
    return pairs[-1][0]


def fit(samples: list[dict[str, Any]], quantile: float) -> dict[tuple[str, int], tuple[float, int]]:
    """(tag, layer) -> (ratio measured / predicted, number of requests)."""
    ratios: dict[tuple[str, int], tuple[list[float], list[float]]] = {}
    for sample in samples:
        total = sum(sample["predicted"].values())
        ratio = sample["measured"] / total
        for key, predicted in sample["predicted"].items():
            values, weights = ratios.setdefault(key, ([], []))
            values.append(ratio)
            weights.append(predicted / total)
    return {key: (weighted_quantile(v, w, quantile), len(v)) for key, (v, w) in ratios.items()}


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fallbackgate calibrate``."""
    if not 0.0 < args.quantile <= 1.0:
        print(f"fallbackgate calibrate: error: --quantile must be in (0, 1], got {args.quantile}", file=sys.stderr)
        return 2
    try:
        ledger = open_ledger(args.ledger, must_exist=True)
    except LedgerError as exc:
        print(f"fallbackgate calibrate: error: {exc}", file=sys.stderr)
        return 2
    samples = request_samples(ledger, args.run)
    if not samples:
        print("fallbackgate calibrate: no audited requests with approximate events to fit on", file=sys.stderr)
        return 1
    current = load_calibration(ledger)
    fitted = fit(samples, args.quantile)
    run_ids = sorted({s["run_id"] for s in samples})
    writer = None if args.dry_run else LedgerWriter(ledger)
    print(f"fitted on {len(samples)} requests of runs {run_ids} (quantile {args.quantile:g})")
    for (tag, layer), (ratio, count) in sorted(fitted.items()):
        if Tag(tag) not in CALIBRATED_TAGS:
            continue
        scale = max(MIN_SCALE, current.scale(Tag(tag), layer) * ratio)
        print(f"  {tag:14s} layer {layer:3d}: ratio {ratio:.3g} -> scale {scale:.4g} ({count} requests)")
        if writer is not None:
            writer.record_calibration(tag, layer, scale, count, run_ids)
    if writer is not None:
        writer.close()
    return 0

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

from fallbackgate.controllers.cost import fit_calibration, store_calibration
from fallbackgate.ledger.db import DEFAULT_LEDGER, ENV_VAR, LedgerError, open_ledger


def add_parser(subparsers: Any) -> None:
    """Register ``calibrate``."""
    p: argparse.ArgumentParser = subparsers.add_parser("calibrate", help="fit predicted-cost scales from a ledger")
    p.add_argument("--ledger", default=None, help=f"ledger URL (default: ${ENV_VAR}, else {DEFAULT_LEDGER})")
    p.add_argument("--run", type=int, action="append", default=[], help="runs to fit on (repeatable; default all)")
    p.add_argument("--quantile", type=float, default=0.95, help="quantile of per-request ratios (default 0.95)")
    p.add_argument("--dry-run", action="store_true", help="print the fit without storing it")
    p.set_defaults(func=run)


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
    fitted = fit_calibration(ledger, args.run, args.quantile)
    if not fitted.num_requests:
        print("fallbackgate calibrate: no audited requests with approximate events to fit on", file=sys.stderr)
        return 1
    print(f"fitted on {fitted.num_requests} requests of runs {fitted.run_ids} (quantile {args.quantile:g})")
    for s in fitted.scales:
        fit_line = f"ratio {s.ratio:.3g} -> scale {s.scale:.4g} ({s.num_requests} requests)"
        print(f"  {s.tag.value:14s} layer {s.layer:3d}: {fit_line}")
    if not args.dry_run:
        store_calibration(ledger, fitted)
    return 0

"""``fallbackgate report --trace DIR... --out FILE.md [--ledger URL | --no-ledger] [--run ID]``: analyse the
traces and write one markdown report answering PROBE.md's six questions with their numbers; figures go to
``FILE_figures/`` beside it, and the numbers to the ledger as ``trace analyze`` stores them.

Exit status: 0 on success, 2 for bad input.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any

from fallbackgate.commands.checks import check_output_path
from fallbackgate.commands.trace import analyze_paths, store_all
from fallbackgate.ledger.db import DEFAULT_LEDGER, ENV_VAR
from fallbackgate.tracing.report import build_report


def add_parser(subparsers: Any) -> None:
    """Register ``report``."""
    p: argparse.ArgumentParser = subparsers.add_parser("report", help="write the markdown report over traces")
    p.add_argument("--trace", action="append", required=True, metavar="DIR", help="a trace directory (repeatable)")
    p.add_argument("--out", metavar="FILE.md", required=True, help="the report file")
    p.add_argument("--ledger", default=None, help=f"ledger URL (default: ${ENV_VAR}, else {DEFAULT_LEDGER})")
    p.add_argument("--no-ledger", action="store_true", help="do not store the numbers in a ledger")
    p.add_argument("--run", type=int, default=None, help="the ledger run the traces were recorded by")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fallbackgate report``."""
    try:
        check_output_path(args.out, "--out")
    except ValueError as exc:
        print(f"fallbackgate report: error: {exc}", file=sys.stderr)
        return 2
    out = pathlib.Path(args.out)
    analyses = analyze_paths(args.trace, out.parent / f"{out.stem}_figures", "report")
    if analyses is None:
        return 2
    if not args.no_ledger and not store_all(analyses, args.ledger, args.run, "report"):
        return 2
    build_report(analyses, out)
    print(f"wrote {out}")
    return 0

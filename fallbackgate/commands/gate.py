"""``fallbackgate gate --ledger URL [--run ID] [--record]``: print the verdict table of a run.

Each request shows both halves of its verdict: quality (its statistics against the exact baseline, within
its budget) and correctness (exact tolerance, the replay of its recorded actions, a complete ledger).

Exit status: 0 when the run passes, 1 when it fails, 2 for a ledger that cannot be opened or a run
that does not exist.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fallbackgate.audit.gate import RunVerdict, evaluate_run
from fallbackgate.audit.table import print_table
from fallbackgate.audit.verdicts import record_verdicts
from fallbackgate.ledger import queries
from fallbackgate.ledger.db import DEFAULT_LEDGER, ENV_VAR, LedgerError, open_ledger
from fallbackgate.ledger.writer import LedgerWriter


def add_parser(subparsers: Any) -> None:
    """Register the ``gate`` subcommand on an argparse subparsers object."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "gate", help="judge a run against its quality budgets; exit 1 on failure"
    )
    p.add_argument(
        "--ledger",
        default=None,
        help=f"ledger URL or SQLite path (default: ${ENV_VAR}, else {DEFAULT_LEDGER})",
    )
    p.add_argument("--run", type=int, default=None, help="run id (default: the newest run)")
    p.add_argument("--record", action="store_true", help="also write the verdicts into the ledger")
    p.set_defaults(func=run)


def _record(url: str | None, verdict: RunVerdict) -> None:
    with open_ledger(url) as ledger, LedgerWriter(ledger) as writer:
        record_verdicts(writer, verdict)


def run(args: argparse.Namespace) -> int:
    """Run the gate command; return the process exit status."""
    try:
        with open_ledger(args.ledger, read_only=True) as ledger:
            run_id = args.run if args.run is not None else queries.latest_run_id(ledger)
            if run_id is None:
                raise LedgerError(f"ledger {ledger.display_url} has no runs")
            verdict = evaluate_run(ledger, run_id)
        if getattr(args, "record", False):
            _record(args.ledger, verdict)
    except LedgerError as exc:
        print(f"fallbackgate gate: error: {exc}", file=sys.stderr)
        return 2
    print_table(verdict)
    return 0 if verdict.passed else 1

"""``fallbackgate audit --ledger URL [--workers N] [--lease-s S] [--run ID]``: audit workers.

Claims the deferred audit tasks that ``fallbackgate run --audit deferred`` left in the ledger, audits each
request against both baselines, then judges each run whose requests are all audited. Exits when no task
is left. With ``--workers N`` it starts N worker processes; any number of these commands, on any number
of machines, can share one PostgreSQL ledger (a SQLite ledger takes one worker at a time).

Exit status: 0 when every task it took was done, 1 when a task failed, 2 for bad arguments or a ledger
that cannot be opened.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
from typing import Any

import torch

from fallbackgate.audit.worker import audit_loop
from fallbackgate.ledger.audit_queue import task_counts
from fallbackgate.ledger.db import DEFAULT_LEDGER, ENV_VAR, LedgerError, open_ledger

MAX_WORKERS = 64


def add_parser(subparsers: Any) -> None:
    """Register the ``audit`` subcommand."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "audit", help="claim and do deferred audits from a shared ledger (audit workers)"
    )
    p.add_argument("--ledger", default=None, help=f"ledger URL (default: ${ENV_VAR}, else {DEFAULT_LEDGER})")
    p.add_argument("--workers", type=int, default=1, help=f"worker processes, 1-{MAX_WORKERS} (default 1)")
    p.add_argument("--lease-s", type=float, default=60.0, help="seconds a claim holds without renewal (default 60)")
    p.add_argument("--run", type=int, default=None, help="only this run's tasks (default: every run's)")
    p.add_argument("--max-tasks", type=int, default=None, help="stop after this many tasks per worker")
    p.add_argument("--follow", action="store_true", help="with --run: keep working until that run stops serving")
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: cores / workers)")
    p.add_argument("--nice", type=int, default=0, help="lower the workers' CPU priority by this much (0-19)")
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    if not 1 <= args.workers <= MAX_WORKERS:
        raise ValueError(f"--workers must be 1..{MAX_WORKERS}, got {args.workers}")
    if not 1.0 <= args.lease_s <= 86400.0:
        raise ValueError(f"--lease-s must be 1..86400 seconds, got {args.lease_s}")
    if args.max_tasks is not None and args.max_tasks < 1:
        raise ValueError(f"--max-tasks must be >= 1, got {args.max_tasks}")
    if args.follow and args.run is None:
        raise ValueError("--follow needs --run: the run whose serving it follows")
    if args.threads is not None and not 1 <= args.threads <= 256:
        raise ValueError(f"--threads must be 1..256, got {args.threads}")
    if not 0 <= args.nice <= 19:
        raise ValueError(f"--nice must be 0..19, got {args.nice}")


def _worker(
    url: str, lease_s: float, run_id: int | None, max_tasks: int | None, threads: int, follow: bool, nice: int
) -> dict[str, Any]:
    torch.set_num_threads(threads)
    if nice:
        os.nice(nice)
    return audit_loop(url, lease_s, run_id, max_tasks, follow)


def run(args: argparse.Namespace) -> int:
    """Run the workers until no task is left; print what they did."""
    try:
        _check(args)
    except ValueError as exc:
        print(f"fallbackgate audit: error: {exc}", file=sys.stderr)
        return 2
    try:
        with open_ledger(args.ledger) as ledger:
            url = ledger.url.render_as_string(hide_password=False)
            if ledger.is_sqlite and args.workers > 1:
                raise LedgerError(
                    f"--workers {args.workers}: ledger {ledger.display_url} is SQLite, which takes one audit "
                    "worker at a time; use a PostgreSQL ledger for more"
                )
            before = task_counts(ledger, args.run)
    except LedgerError as exc:
        print(f"fallbackgate audit: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"audit: {before.get('pending', 0)} pending, {before.get('claimed', 0)} claimed, {before.get('done', 0)} done"
    )
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.workers)
    jobs = [(url, args.lease_s, args.run, args.max_tasks, threads, args.follow, args.nice)] * args.workers
    if args.workers == 1:
        results = [_worker(*jobs[0])]
    else:
        with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
            results = pool.starmap(_worker, jobs)
    total = {k: sum(r[k] for r in results) for k in results[0]}
    print(
        f"audit: {total['num_requests']} request(s) audited, {total['num_runs']} run(s) judged, "
        f"{total['num_lost']} task(s) lost to an expired lease, by {args.workers} worker(s)"
    )
    return 0

"""The ``fallbackgate`` command line: one subcommand per module in ``fallbackgate.commands`` (``trace``'s simulate
and validate in ``trace_simulate``)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from fallbackgate.commands import (
    audit,
    calibrate,
    dashboard,
    gate,
    lmeval,
    load,
    parity,
    plan,
    policy,
    profile,
    report,
    run,
    serve,
    sweep,
    trace,
    verify,
    workload,
)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="fallbackgate", description="Honest MoE inference under memory pressure.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    commands = (run, serve, plan, gate, audit, lmeval, dashboard, policy, parity, calibrate, sweep, verify, profile)
    for module in (*commands, workload, load, trace, report):
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` and run the chosen subcommand; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    received: list[int] = []

    def on_term(signum: int, _frame: object) -> None:  # SIGTERM ends a command the way Ctrl-C does
        received.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term) if threading.current_thread() is threading.main_thread() else None
    try:
        if argv[:1] == ["lm-eval"]:  # everything after it is lm-eval's, options included
            return lmeval.run(argparse.Namespace(lm_eval_args=argv[1:]))
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        name, command = ("SIGTERM" if received else "SIGINT"), (argv[0] if argv else "")
        after = "; what it recorded is flushed and its run marked interrupted" if command == "run" else ""
        print(f"fallbackgate {command}: stopped by {name}{after}", file=sys.stderr)
        return 128 + (signal.SIGTERM if received else signal.SIGINT)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())

"""The ``fallbackgate`` command line: one subcommand per module in ``fallbackgate.commands``."""

from __future__ import annotations

import argparse
import sys

from fallbackgate.commands import (
    audit,
    calibrate,
    dashboard,
    gate,
    lmeval,
    parity,
    plan,
    policy,
    profile,
    run,
    serve,
    sweep,
    verify,
)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="fallbackgate", description="Honest MoE inference under memory pressure.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in (run, serve, plan, gate, audit, lmeval, dashboard, policy, parity, calibrate, sweep, verify, profile):
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` and run the chosen subcommand; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["lm-eval"]:  # everything after it is lm-eval's, options included
        return lmeval.run(argparse.Namespace(lm_eval_args=argv[1:]))
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""``fallbackgate parity --policy FILE --tasks a,b [--limit N]``: a policy against the exact engine on lm-eval tasks.

Exit status: 0 when every task is within the policy's parity tolerances, 1 when one is not, 2 for bad input
(policy file, task name, data file, model directory), found before any model is loaded.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_parser(subparsers: Any) -> None:
    """Register ``parity``."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "parity", help="compare a policy with the exact engine on lm-eval tasks, item by item"
    )
    p.add_argument("--policy", required=True, help="policy YAML (its `parity` section declares the tolerances)")
    p.add_argument(
        "--tasks", required=True, help="comma-separated task names (local: fg_cloze,fg_rolling_ppl,fg_names)"
    )
    p.add_argument("--limit", type=int, default=None, help="items per task (default: all)")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the policy's, else the bundled one)")
    p.add_argument("--report-dir", default=None, help="write parity.md and parity.json here")
    p.add_argument("--include-path", action="append", default=[], help="extra lm-eval task YAML directory")
    p.add_argument("--data-dir", default=None, help="data for the bundled task YAMLs (default: evals/data)")
    p.add_argument("--ledger", default=None, help="ledger URL (default: the policy's, else $FALLBACKGATE_LEDGER)")
    p.add_argument("--force", action="append", default=[], help="force a fallback tag on an exact_lru policy (testing)")
    p.add_argument("--batch-size", type=int, default=64, help="requests in flight in the engine at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--chunk-tokens",
        type=int,
        default=4096,
        help="engine tokens per forward (default: a whole window, as lm-eval's hf model; smaller values split "
        "windows into prefill chunks whose later chunks read earlier KV through the policy's fallbacks)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fallbackgate parity``."""
    from fallbackgate.evals.parity import ParityConfig, ParityInputError, prepare, run_parity
    from fallbackgate.evals.parity_report import failure_lines, to_markdown, write_reports

    config = ParityConfig(
        args.policy,
        [t.strip() for t in args.tasks.split(",") if t.strip()],
        args.limit,
        args.model,
        args.report_dir,
        list(args.include_path),
        args.data_dir,
        args.ledger,
        list(args.force),
        args.batch_size,
        args.seed,
        args.chunk_tokens,
    )
    try:
        prepared = prepare(config)
    except ParityInputError as exc:
        print(f"fallbackgate parity: error: {exc}", file=sys.stderr)
        return 2
    from fallbackgate.engine.errors import EngineError

    try:
        report = run_parity(prepared)
    except EngineError as exc:  # e.g. a device budget below the minimum, a checkpoint it cannot load
        print(f"fallbackgate parity: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(to_markdown(report))
    if args.report_dir:
        md, js = write_reports(report, args.report_dir)
        print(f"\nreports: {md} {js}")
    for line in failure_lines(report):
        print(line, file=sys.stderr)
    return 0 if report["passed"] else 1

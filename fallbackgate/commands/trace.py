"""``fallbackgate trace analyze TRACE... --out DIR [--ledger URL | --no-ledger] [--run ID]``: every analysis of
each trace (co-burst, marginal value, flips, dual-miss crossover, prediction, devices); PNG figures to DIR,
the numbers to the ledger's ``trace_analyses`` table (the dashboard's Traces page reads them).

``fallbackgate trace simulate`` and ``fallbackgate trace validate``: :mod:`fallbackgate.commands.trace_simulate`.

``fallbackgate trace planted --out DIR [--seed S] [--steps N]``: write the planted synthetic trace CI checks
the analyses on.

``fallbackgate trace import-vllm FILE --out DIR [--model CKPT] [--block-size N] [--step-ms MS]``: vLLM's
routed-experts output (OpenAI completion responses, JSON or JSON lines) as a trace; KV reads, steps and
request times synthesised from the request lengths (the metadata says which).

Exit status: 0 on success, 2 for bad input (an unreadable trace, a bad ledger).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Any

from fallbackgate.commands.trace_simulate import add_simulate_parsers
from fallbackgate.ledger.db import DEFAULT_LEDGER, ENV_VAR, LedgerError, open_ledger
from fallbackgate.tracing.analyze import TraceAnalysis, analyze_trace, store, trace_labels
from fallbackgate.tracing.reader import read_trace
from fallbackgate.tracing.synthetic import Planted, write_planted_trace
from fallbackgate.tracing.vllm_trace import import_vllm
from fallbackgate.tracing.writer import TraceFormatError


def add_parser(subparsers: Any) -> None:
    """Register ``trace`` and its subcommands."""
    p: argparse.ArgumentParser = subparsers.add_parser("trace", help="joint traces: analyse, or write a planted one")
    sub = p.add_subparsers(dest="trace_command", required=True)
    a = sub.add_parser("analyze", help="analyse traces: figures to --out, numbers to the ledger")
    a.add_argument("traces", nargs="+", metavar="TRACE", help="trace directories (format v1)")
    a.add_argument("--out", metavar="DIR", required=True, help="directory for the PNG figures")
    a.add_argument("--ledger", default=None, help=f"ledger URL (default: ${ENV_VAR}, else {DEFAULT_LEDGER})")
    a.add_argument("--no-ledger", action="store_true", help="write figures only")
    a.add_argument("--run", type=int, default=None, help="the ledger run the traces were recorded by")
    a.set_defaults(func=run_analyze)
    add_simulate_parsers(sub)
    s = sub.add_parser("planted", help="write the planted synthetic trace")
    s.add_argument("--out", metavar="DIR", required=True, help="the trace directory to create (new or empty)")
    s.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    s.add_argument("--steps", type=int, default=500, help="decode steps per phase (default 500)")
    s.set_defaults(func=run_planted)
    v = sub.add_parser("import-vllm", help="vLLM's routed-experts output as a trace")
    v.add_argument("file", metavar="FILE", help="OpenAI completion responses with routed_experts (JSON or JSON lines)")
    v.add_argument("--out", metavar="DIR", required=True, help="the trace directory to create (new or empty)")
    v.add_argument("--model", metavar="CKPT", default=None, help="the model's checkpoint dir or config.json")
    v.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (default 16, vLLM's)")
    v.add_argument("--step-ms", type=float, default=1.0, help="nominal step time (default 1 ms)")
    v.add_argument("--workload", default=None, help="workload name (default: the file's stem)")
    v.set_defaults(func=run_import_vllm)


def analyze_paths(paths: list[str], out_dir: pathlib.Path, command: str) -> list[TraceAnalysis] | None:
    """Read and analyse every trace; None (after printing why) when one cannot be read."""
    try:
        traces = [read_trace(path) for path in paths]
        return [analyze_trace(t, out_dir, label) for t, label in zip(traces, trace_labels(traces), strict=True)]
    except TraceFormatError as exc:
        print(f"fallbackgate {command}: error: {exc}", file=sys.stderr)
        return None


def store_all(analyses: list[TraceAnalysis], url: str | None, run_id: int | None, command: str) -> bool:
    """Store every analysis in the ledger at ``url``; False (after printing why) when the ledger refuses."""
    try:
        with open_ledger(url) as ledger:
            for analysis in analyses:
                num = store(ledger, analysis, run_id)
                print(f"{analysis.trace.path}: {num} rows to {ledger.display_url}")
    except LedgerError as exc:
        print(f"fallbackgate {command}: error: {exc}", file=sys.stderr)
        return False
    return True


def run_analyze(args: argparse.Namespace) -> int:
    """Entry point of ``fallbackgate trace analyze``."""
    out = pathlib.Path(args.out)
    if out.exists() and not out.is_dir():
        print(f"fallbackgate trace analyze: error: --out {out}: not a directory", file=sys.stderr)
        return 2
    analyses = analyze_paths(args.traces, out, "trace analyze")
    if analyses is None:
        return 2
    for analysis in analyses:
        for result in analysis.results:
            for figure in result.figures:
                print(f"wrote {figure}")
    if not args.no_ledger and not store_all(analyses, args.ledger, args.run, "trace analyze"):
        return 2
    return 0


def run_planted(args: argparse.Namespace) -> int:
    """Entry point of ``fallbackgate trace planted``."""
    if args.steps < 20:
        print(f"fallbackgate trace planted: error: --steps must be at least 20, got {args.steps}", file=sys.stderr)
        return 2
    try:
        planted = write_planted_trace(args.out, Planted(seed=args.seed, num_steps_per_phase=args.steps))
    except TraceFormatError as exc:
        print(f"fallbackgate trace planted: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: planted lift {planted.expected_lift:.4g}, lag {planted.kv_lag_steps} steps")
    return 0


def run_import_vllm(args: argparse.Namespace) -> int:
    """Entry point of ``fallbackgate trace import-vllm``."""
    try:
        rows = import_vllm(args.file, args.out, args.model, args.block_size, int(args.step_ms * 1e6), args.workload)
    except TraceFormatError as exc:
        print(f"fallbackgate trace import-vllm: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: " + ", ".join(f"{n} {t}" for t, n in rows.items() if n))
    return 0

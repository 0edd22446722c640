"""``fallbackgate load FILE --url URL [--concurrency N] [--time-scale F] [--model NAME] [--json PATH]``: send a
workload file's requests to a running ``fallbackgate serve`` (or any OpenAI-compatible server) at their arrival
times, at most N in flight, and report measured TTFT/TPOT p50/p99, throughput and errors as JSON.

Exit status: 0 when every request succeeded, 1 when any failed, 2 for bad arguments or a server that does not
answer ``/v1/models``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import pathlib
import sys
from typing import Any

import httpx

from fallbackgate.batch.prompts import PromptsFileError, load_prompts
from fallbackgate.commands.checks import check_output_path
from fallbackgate.workloads.load import load_report, run_load


def add_parser(subparsers: Any) -> None:
    """Register ``load``."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "load", help="send a workload file to a server at its arrival times; report TTFT/TPOT as JSON"
    )
    p.add_argument("file", metavar="FILE", help="prompts file (JSONL; `fallbackgate workload` writes arrival_s)")
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's /v1 base URL")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at most (default 8)")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiply arrival times (0.5: twice as fast)")
    p.add_argument("--model", default=None, help="model name to send (default: the first /v1/models lists)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="seconds one request may take (default 300)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the report and every request here")
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    if not 1 <= args.concurrency <= 4096:
        raise ValueError(f"--concurrency must be 1..4096, got {args.concurrency}")
    if not 0.0 <= args.time_scale <= 1000.0:
        raise ValueError(f"--time-scale must be 0..1000, got {args.time_scale}")
    if not 0.1 <= args.timeout_s <= 86400.0:
        raise ValueError(f"--timeout-s must be 0.1..86400, got {args.timeout_s}")
    if not args.url.startswith(("http://", "https://")):
        raise ValueError(f"--url must be an http(s) URL such as http://127.0.0.1:8000/v1, got {args.url!r}")
    if args.json is not None:
        check_output_path(args.json, "--json")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fallbackgate load``."""
    try:
        _check(args)
        specs = load_prompts(args.file)
    except (ValueError, PromptsFileError) as exc:
        print(f"fallbackgate load: error: {exc}", file=sys.stderr)
        return 2
    base = args.url.rstrip("/").removesuffix("/v1")
    try:
        outcomes, wall_s = asyncio.run(
            run_load(
                base,
                specs,
                model=args.model,
                concurrency=args.concurrency,
                time_scale=args.time_scale,
                timeout_s=args.timeout_s,
            )
        )
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        print(f"fallbackgate load: error: {args.url}/models did not answer as a server should: {exc}", file=sys.stderr)
        return 2
    report = {"url": args.url, "file": str(args.file), **load_report(outcomes, wall_s, args.concurrency)}
    print(json.dumps(report, indent=2))
    if args.json is not None:
        full = {**report, "requests": [dataclasses.asdict(o) for o in outcomes]}
        pathlib.Path(args.json).write_text(json.dumps(full, indent=2) + "\n")
    return 0 if report["num_errors"] == 0 else 1

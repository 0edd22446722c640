"""``fallbackgate workload NAME --out FILE [--seed S] [--num-requests N] [--rate R] [--phases N] [--model DIR]
[--max-model-len N] [--corpus DIR | --no-corpus] [--class NAME]``: write a prompts file with arrival times.

Lengths are fractions of the model's length limit in its own tokens; every request fits the limit. The same
arguments (and text sources) give byte-identical files. Exit status: 0 written, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
from typing import Any

from fallbackgate.batch.prompts import MAX_CLASS_CHARS
from fallbackgate.commands.checks import check_output_path
from fallbackgate.tinymoe import CHECKPOINT_DIR
from fallbackgate.workloads.build import generate, prompt_specs, summary_lines, to_jsonl
from fallbackgate.workloads.kinds import Context, WorkloadKind, kind_entry, registered_kinds
from fallbackgate.workloads.text import CORPUS_ENV, TextPool, find_corpus
from fallbackgate.workloads.tokens import DEFAULT_MAX_MODEL_LEN, ModelTokens, length_limit

MIN_LIMIT = 128  # the prompts' frames and shortest texts need this many tokens


def add_parser(subparsers: Any) -> None:
    """Register ``workload``."""
    kinds = "\n".join(f"  {k.value:<15} {kind_entry(k).about}" for k in registered_kinds())
    p: argparse.ArgumentParser = subparsers.add_parser(
        "workload",
        help="write a prompts file with arrival times for one of the probe's workloads",
        description="Write a prompts file (JSONL: id, arrival_s, max_new_tokens, prompt; multi-turn also session\n"
        "and turn) whose lengths are fractions of the model's length limit in its own tokens.\n\n"
        f"kinds:\n{kinds}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", metavar="NAME", choices=[k.value for k in registered_kinds()], help="the workload kind")
    p.add_argument("--out", metavar="FILE", required=True, help="the prompts file to write")
    p.add_argument("--seed", metavar="S", type=int, default=0, help="the same seed gives the same file (default: 0)")
    p.add_argument("--num-requests", metavar="N", type=int, default=32, help="requests, turns included (default: 32)")
    p.add_argument(
        "--rate",
        metavar="R",
        type=float,
        default=None,
        help="arrivals per second (multi-turn: of sessions; mixed: within every burst; default: the kind's)",
    )
    p.add_argument("--phases", metavar="N", type=int, default=4, help="mixed: phases, one kind each (default: 4)")
    p.add_argument("--model", metavar="DIR", default=str(CHECKPOINT_DIR), help="checkpoint (default: bundled)")
    p.add_argument(
        "--max-model-len",
        metavar="N",
        type=int,
        default=None,
        help=f"the engine's max_model_len, capped by the model's positions (default: {DEFAULT_MAX_MODEL_LEN})",
    )
    corpus = p.add_mutually_exclusive_group()
    corpus.add_argument(
        "--corpus",
        metavar="DIR",
        default=None,
        help=f"book corpus besides the bundled passages (default: ${CORPUS_ENV} or shared/data/corpus if found)",
    )
    corpus.add_argument("--no-corpus", action="store_true", help="the bundled passages only")
    p.add_argument("--class", metavar="NAME", dest="request_class", default="default", help="every request's class")
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    for name, low in (("num_requests", 1), ("phases", 2)):
        if getattr(args, name) < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    if args.name == WorkloadKind.MIXED.value and args.num_requests < args.phases:
        raise ValueError(f"--num-requests ({args.num_requests}) must be >= --phases ({args.phases}) for mixed")
    if args.rate is not None and not 0 < args.rate < float("inf"):
        raise ValueError(f"--rate must be a positive number of arrivals per second, got {args.rate}")
    if args.max_model_len is not None and args.max_model_len < MIN_LIMIT:
        raise ValueError(f"--max-model-len must be >= {MIN_LIMIT}, got {args.max_model_len}")
    if not 1 <= len(args.request_class) <= MAX_CLASS_CHARS:
        raise ValueError(f"--class must be 1..{MAX_CLASS_CHARS} characters, got {len(args.request_class)}")
    check_output_path(args.out, "--out")


def _context(args: argparse.Namespace) -> tuple[Context, str]:
    """The generation context and a line describing the limit; ValueErrors name the flag."""
    try:
        limit = length_limit(args.model, args.max_model_len)
        tokens = ModelTokens(args.model)
    except ValueError as exc:
        raise ValueError(f"--model {args.model}: {exc}") from None
    if limit.tokens < MIN_LIMIT:
        raise ValueError(f"--model {args.model}: a length limit of {limit.tokens} is below {MIN_LIMIT} tokens")
    flag = f"${CORPUS_ENV}" if args.corpus is None and os.environ.get(CORPUS_ENV) else "--corpus"
    if args.no_corpus:
        corpus_dir = None
    else:
        corpus_dir = pathlib.Path(args.corpus) if args.corpus is not None else find_corpus()
    try:
        pool = TextPool.load(tokens, corpus_dir)
    except ValueError as exc:
        raise ValueError(f"{flag} {corpus_dir}: {exc}") from None
    return Context(tokens, pool, limit.tokens, num_phases=args.phases), limit.describe()


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fallbackgate workload``."""
    try:
        _check(args)
        ctx, limit_line = _context(args)
        workload = generate(ctx, WorkloadKind(args.name), args.seed, args.num_requests, args.rate)
    except ValueError as exc:
        print(f"fallbackgate workload: error: {exc}", file=sys.stderr)
        return 2
    pathlib.Path(args.out).write_text(to_jsonl(prompt_specs(workload, args.request_class)), encoding="utf-8")
    print(f"fallbackgate workload: wrote {args.name} (seed {args.seed}) to {args.out}")
    print(f"  model limit: {limit_line}")
    for line in summary_lines(workload, ctx.text.sources):
        print(line)
    return 0

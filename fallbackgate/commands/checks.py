"""Checks commands make on their arguments before doing anything."""

from __future__ import annotations

import argparse
import os
import pathlib
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def check_output_path(path: str, flag: str) -> None:
    """The directory an output file goes to exists and is writable (checked before any work)."""
    target = pathlib.Path(path)
    if target.is_dir():
        raise ValueError(f"{flag} {path}: is a directory; give a file path")
    parent = target.parent if str(target.parent) else pathlib.Path(".")
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{flag} {path}: directory {parent} is not writable")


def comma_separated(
    convert: Callable[[str], T], noun: str, is_valid: Callable[[T], bool], rule: str
) -> Callable[[str], tuple[T, ...]]:
    """An argparse ``type`` for a comma-separated list of `noun` (``convert`` each item), none empty, each passing
    ``is_valid`` (``rule`` says what that means in the error)."""

    def parse(text: str) -> tuple[T, ...]:
        try:
            values = tuple(convert(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {noun}, got {text!r}") from None
        if not values or not all(is_valid(v) for v in values):
            raise argparse.ArgumentTypeError(f"{rule}, got {text!r}")
        return values

    return parse


def add_kv_flags(parser: argparse.ArgumentParser) -> None:
    """``--max-model-len``, ``--no-prefix-reuse`` and ``--prefix-cache-mb`` (policy ``memory`` overrides)."""
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="prompt + output tokens per request (default 2048), capped by the model's max_position_embeddings",
    )
    parser.add_argument(
        "--no-prefix-reuse",
        dest="prefix_reuse",
        action="store_const",
        const=False,
        default=None,
        help="do not keep full KV blocks after their request for later requests with the same prefix "
        "(default: kept and reused, policy memory.prefix_reuse)",
    )
    parser.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=None,
        help="kept prefix blocks in RAM at most, MiB (default 256, policy memory.prefix_cache_mb); the least "
        "recently used are dropped beyond it",
    )


def add_trace_flag(parser: argparse.ArgumentParser) -> None:
    """``--trace DIR``: write the run's joint trace (format v1) there, live."""
    parser.add_argument(
        "--trace",
        default=None,
        metavar="DIR",
        help="write the run's trace (every expert and KV access, I/O, arbitration and request; format v1, see "
        "the README) into DIR, which must be new or empty; the ledger's run row points to it",
    )


def check_trace_flag(args: argparse.Namespace) -> None:
    """``--trace DIR`` names a new or empty directory whose parent exists, and a ledger records the run."""
    if getattr(args, "trace", None) is None:
        return
    target = pathlib.Path(args.trace)
    if getattr(args, "no_ledger", False):
        raise ValueError("--trace needs the ledger (the run row points to the trace): drop --no-ledger")
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ValueError(f"--trace {args.trace}: must be a new or empty directory")
    parent = target.absolute().parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ValueError(f"--trace {args.trace}: directory {parent} does not exist or is not writable")

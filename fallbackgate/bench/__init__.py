"""Benchmarks (each ``python -m fallbackgate.bench.<name> --json FILE``): ratios measured in one run."""

import json
import pathlib
import sys
from typing import Any


def write_results(path: str | pathlib.Path, **parts: Any) -> None:
    """A benchmark's JSON: the command that produced it, then `parts`."""
    pathlib.Path(path).write_text(json.dumps({"command": " ".join(sys.argv), **parts}, indent=1))

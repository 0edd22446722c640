"""python -m fallbackgate.bench.kv_shares RESULTS.json [RESULTS.json ...]

The KV share of the bytes a ``trace simulate`` run moved, per configuration (modelled: no real I/O): KV block
reads and KV spill writes over all bytes moved (reads by tag, spill writes, prefetches), with the spill bytes,
the modelled stall and how many layer gathers did not fit the budget (``num_unfit_gathers`` > 0: a
configuration the engine could not serve). One line per configuration, each file's in its order.
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

MIB = 2**20


def kv_share(result: dict[str, Any]) -> float:
    """KV blocks' bytes (reads of every KV tag and spill writes) over every byte the configuration moved."""
    moved = result["bytes_by_tag"]
    kv = sum(v for k, v in moved.items() if k.startswith("kv")) + result["spill_bytes"]
    total = sum(moved.values()) + result["spill_bytes"] + result["prefetch_bytes"]
    return kv / total if total else 0.0


def line(label: str, result: dict[str, Any]) -> str:
    """One configuration's line (or its error)."""
    share = result.get("expert_fraction") or "-"
    head = f"{label} {result['controller']:12} KV x{result['kv_bytes_scale']:<4g} expert share {share:<4} " \
           f"budget {result['budget_gib'] * 1024:5.1f} MiB"  # fmt: skip
    if "error" in result:
        return f"{head}  error: {result['error']}"
    moved = sum(result["bytes_by_tag"].values()) + result["spill_bytes"] + result["prefetch_bytes"]
    spill = result["spill_bytes"] / MIB
    return (f"{head} unfit gathers {result['num_unfit_gathers']:5d}  KV share {kv_share(result):.3f}  spill "
            f"{spill:7.1f} MiB of {moved / MIB:7.1f}  stall {result['stall_s']:.2f} s (modelled)")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Print every configuration's line; 2 when a file cannot be read."""
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        return 2
    for path in paths:
        try:
            results = json.loads(pathlib.Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            print(f"kv_shares: {path}: {exc}", file=sys.stderr)
            return 2
        for result in results:
            print(line(pathlib.Path(path).stem, result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

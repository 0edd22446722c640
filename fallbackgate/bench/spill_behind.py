"""python -m fallbackgate.bench.spill_behind [--dir DIR] [--blocks 5,10,15] [--repeats 30] [--json FILE]

What a step's end pays to spill KV blocks to disk, written at once (each write waited for before the next
block, as every spill was before stop 46) or behind the step (prepared, queued together, waited for when the
next step starts): the bundled model's 8 KiB blocks (2 KV heads × 16 positions × 64 K+V values, fp32, one
per layer and block index) through the engine's own KV store, I/O scheduler (4 workers) and ``O_DIRECT``
spill files in DIR. Per block count: the median wall time of the spills inside the step, and for
write-behind the wait left at the drain when it comes at once (the engine's next step starts after the
caller's own work, so less is left there). The two ways are interleaved, repeat by repeat. JSON out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from fallbackgate.engine.device_pool import TierPool
from fallbackgate.engine.io import IOScheduler
from fallbackgate.engine.kv.spill import SpillDir
from fallbackgate.engine.kv.store import KVStore, SpillMode

NUM_LAYERS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM = 5, 2, 16, 32  # the bundled model's KV geometry


def spill_once(kv: KVStore, num_blocks: int, is_behind: bool, tag: int) -> tuple[float, float]:
    """Spill `num_blocks` fresh blocks; seconds inside the step and seconds of the drain after it."""
    request_id = f"r{tag}"
    kv.add_sequence(request_id)
    per_layer = -(-num_blocks // NUM_LAYERS)
    kv.append(request_id, BLOCK_SIZE * per_layer)
    for layer in range(NUM_LAYERS):
        shape = (NUM_KV_HEADS, BLOCK_SIZE * per_layer, HEAD_DIM)
        kv.write(request_id, layer, 0, torch.randn(shape), torch.randn(shape))
    blocks = [b for layer in range(NUM_LAYERS) for b in kv.blocks(request_id, layer)][:num_blocks]
    started = time.perf_counter()
    with kv.spill.writing_behind() if is_behind else contextlib.nullcontext():
        for block in blocks:
            kv.spill_block(block, SpillMode.DISK_FULL, is_behind)
    in_step = time.perf_counter() - started
    started = time.perf_counter()
    kv.finish_writes()
    drain = time.perf_counter() - started
    kv.free_sequence(request_id)
    return in_step, drain


def measure(directory: str, block_counts: list[int], repeats: int) -> dict[str, Any]:
    """Interleaved runs of both ways per block count; medians in ms."""
    io = IOScheduler(num_workers=4)
    spill = SpillDir(directory)
    spill.attach_io(io)
    ram = TierPool("RAM", 1 << 30)
    kv = KVStore(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM, BLOCK_SIZE, ram, None, spill, torch.device("cpu"))
    kv.write_behind_pool = ram
    rows = []
    try:
        for num_blocks in block_counts:
            times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
            for i in range(repeats):
                for is_behind in (False, True) if i % 2 == 0 else (True, False):
                    times[is_behind].append(spill_once(kv, num_blocks, is_behind, len(rows) * 10_000 + i * 2))
            at_once = statistics.median(t for t, _ in times[False]) * 1e3
            behind = statistics.median(t for t, _ in times[True]) * 1e3
            drain = statistics.median(d for _, d in times[True]) * 1e3
            rows.append({"blocks": num_blocks, "at_once_ms": at_once, "behind_in_step_ms": behind,
                         "behind_drain_ms": drain, "in_step_ratio": behind / at_once})  # fmt: skip
            print(
                f"{num_blocks:3d} blocks of {kv.bytes_per_block} B: written at once {at_once:.2f} ms; behind "
                f"{behind:.2f} ms in the step ({behind / at_once:.2f}x), drain at once after it {drain:.2f} ms"
            )
    finally:
        kv.close()
        io.close()
    return {"bytes_per_block": kv.bytes_per_block, "repeats": repeats, "io_workers": 4, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fallbackgate.bench.spill_behind", description=__doc__.splitlines()[2])
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the spill files go (a disk, not tmpfs)")
    p.add_argument("--blocks", default="5,10,15", help="block counts spilled at one step's end")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    try:
        counts = [int(x) for x in args.blocks.split(",")]
    except ValueError:
        p.exit(2, f"--blocks: expected comma-separated integers, got {args.blocks!r}\n")
    result = {"command": " ".join(["python -m fallbackgate.bench.spill_behind", *sys.argv[1:]]),
              **measure(args.dir, counts, args.repeats)}  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

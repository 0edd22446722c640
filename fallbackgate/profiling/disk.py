"""Measure the disk as latency plus bandwidth by transfer size and queue depth, reads, writes and both mixed.

Each point keeps `depth` transfers of one size in flight through the engine's own I/O scheduler (one
worker per transfer in flight) against a scratch file on the measured directory's file system, at random
aligned offsets, for a short time (at least `depth` transfers); each transfer is timed from submission to
completion. Reads go around the page cache (``O_DIRECT``; where the file system refuses it, the file's pages
are dropped before every point and the table says ``is_direct=False``): a read served from the page cache
is not a disk read. The scratch file is removed afterwards.
"""

from __future__ import annotations

import collections
import os
import pathlib
import random
import statistics
import tempfile
import time

from fallbackgate.engine.disk_model import DiskOp, DiskPoint, DiskTable
from fallbackgate.engine.io import IOScheduler, Ticket
from fallbackgate.engine.io.direct import ALIGN, aligned_buffer, drop_cached, make_scratch_file
from fallbackgate.engine.tags import ObjectKind

KIB, MIB = 1024, 1024 * 1024
DEFAULT_SIZES: tuple[int, ...] = tuple(4 * KIB * 4**i for i in range(7))  # 4 KiB, 16 KiB, ... 16 MiB
DEFAULT_DEPTHS: tuple[int, ...] = (1, 4, 16, 32)
QUICK_SIZES: tuple[int, ...] = (4 * KIB, 64 * KIB, MIB, 16 * MIB)
QUICK_DEPTHS: tuple[int, ...] = (1, 8, 32)
DEFAULT_SECONDS = 0.12  # per point: the default grid takes about 20 s, the quick one about 5 s
SCRATCH_BYTES = 256 * MIB  # the scratch file: larger than the largest transfer times the deepest queue


def disk_grid(is_quick: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(sizes, depths) the profile measures; the quick grid for ``fallbackgate profile --quick``."""
    return (QUICK_SIZES, QUICK_DEPTHS) if is_quick else (DEFAULT_SIZES, DEFAULT_DEPTHS)


def measure_disk_table(
    directory: pathlib.Path,
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    depths: tuple[int, ...] = DEFAULT_DEPTHS,
    ops: tuple[DiskOp, ...] = tuple(DiskOp),
    seconds_per_point: float | None = None,
    file_bytes: int | None = None,
) -> DiskTable:
    """One point per (op, size, depth) against a scratch file in `directory` (see the module docstring)."""
    if any(s <= 0 or s % ALIGN for s in sizes) or any(d <= 0 for d in depths):
        raise ValueError(f"disk sizes must be positive multiples of {ALIGN} and depths positive")
    file_bytes = file_bytes or max(SCRATCH_BYTES, 4 * max(sizes))
    seconds = DEFAULT_SECONDS if seconds_per_point is None else seconds_per_point
    points: list[DiskPoint] = []
    is_direct = True
    with tempfile.TemporaryDirectory(dir=directory, prefix="fallbackgate-disk-") as scratch:
        path = pathlib.Path(scratch) / "scratch.bin"
        make_scratch_file(path, file_bytes)
        for op in ops:
            for size in sizes:
                for depth in depths:
                    point, was_direct = _measure_point(path, file_bytes, op, size, depth, seconds)
                    points.append(point)
                    is_direct = is_direct and was_direct
    return DiskTable(tuple(points), str(directory), is_direct)


def _measure_point(
    path: pathlib.Path, file_bytes: int, op: DiskOp, size: int, depth: int, seconds: float
) -> tuple[DiskPoint, bool]:
    """Keep `depth` transfers of `size` in flight for `seconds` (at least `depth` of them: the first round)."""
    rng = random.Random(f"{op.value}/{size}/{depth}")
    payload = aligned_buffer(size)
    payload.write(os.urandom(min(size, 64 * KIB)))
    slots = (file_bytes - size) // ALIGN + 1
    latencies: list[float] = []
    is_direct = True
    with IOScheduler(num_workers=depth, max_records=1) as io:
        _drop_pages(path)
        io.start()
        pending: collections.deque[Ticket] = collections.deque()
        count = 0

        def submit() -> None:
            nonlocal count
            offset = rng.randrange(slots) * ALIGN
            is_write = op is DiskOp.WRITE or (op is DiskOp.MIXED and count % 2 == 1)
            if is_write:
                pending.append(io.submit_write(path, offset, payload, ObjectKind.EXPERT, "profile"))
            else:
                pending.append(io.submit_read(path, offset, size, ObjectKind.EXPERT, "profile"))
            count += 1

        began = time.perf_counter()
        stop = began + seconds
        for _ in range(depth):
            submit()
        while pending:
            ticket = pending.popleft()
            io.wait(ticket)
            record = ticket.record
            latencies.append((record.end_ns - record.submit_ns) / 1e9)
            is_direct = is_direct and record.is_direct
            if time.perf_counter() < stop:
                submit()
        elapsed = time.perf_counter() - began
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    median = max(statistics.median(latencies), 1e-9)
    rate = len(latencies) * size / elapsed
    return DiskPoint(op, size, depth, median, p99, rate, len(latencies)), is_direct


def _drop_pages(path: pathlib.Path) -> None:
    """Flush and drop the scratch file's cached pages (what O_DIRECT does not need, buffered reads do)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        drop_cached(fd)
    finally:
        os.close(fd)

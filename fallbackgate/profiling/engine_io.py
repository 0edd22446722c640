"""What a miss costs through the engine's own I/O path, not only the disk's service time.

Each point reads `depth` objects of one size at a time through one shared :class:`IOScheduler` with the
engine's worker count (``max(1, default_io_threads())``, as ``Engine`` builds it), into page-aligned buffers,
from a scratch file with ``O_DIRECT``, at random aligned offsets. For each read it times, on the waiting
(compute) thread: the wait from submission until ``wait`` returned (queueing, the worker's service and the
wakeup of the waiter), the service alone (the record's start to end), the wakeup (the record's end until
``wait`` returned: the dispatch/wakeup overhead per request), then the xxh3-64 of the bytes (the engine
checks every disk read against its manifest) and the copy of the bytes into a slot tensor. Medians and
means per point; the simulator prices a miss at depth 1 as wait + checksum + copy (``tracing/devices.py``).
"""

from __future__ import annotations

import pathlib
import random
import statistics
import tempfile
import time
from typing import Any

import torch
import xxhash

from fallbackgate.engine.config import default_io_threads
from fallbackgate.engine.io import IOScheduler
from fallbackgate.engine.io.direct import ALIGN, aligned_buffer, make_scratch_file
from fallbackgate.engine.tags import ObjectKind
from fallbackgate.profiling.engine_miss import measure_engine_misses

KIB, MIB = 1024, 1024 * 1024
ENGINE_IO_SIZES: tuple[int, ...] = (64 * KIB, 256 * KIB, MIB, 4 * MIB)
ENGINE_IO_DEPTHS: tuple[int, ...] = (1, 4)
READS_PER_POINT = 24
SCRATCH_BYTES = 128 * MIB


def measure_engine_io(
    directory: pathlib.Path,
    sizes: tuple[int, ...] | None = None,
    depths: tuple[int, ...] | None = None,
    reads_per_point: int | None = None,
) -> dict[str, Any]:
    """The engine-path table: ``{"num_workers", "directory", "points": [...], "misses"}``, one point per (size, depth)
    with seconds per read: ``wait_s`` (submit to ``wait`` returned), ``service_s``, ``wakeup_s``,
    ``checksum_s``, ``copy_s`` (medians) and ``mean_total_s`` (mean of wait + checksum + copy). Defaults:
    the module's ``ENGINE_IO_SIZES``, ``ENGINE_IO_DEPTHS``, ``READS_PER_POINT``. ``misses``: the engine's own
    time per expert miss beyond its read (:func:`fallbackgate.profiling.engine_miss.measure_engine_misses`)."""
    sizes, depths = sizes or ENGINE_IO_SIZES, depths or ENGINE_IO_DEPTHS
    reads_per_point = reads_per_point or READS_PER_POINT
    num_workers = max(1, default_io_threads())
    file_bytes = max(min(SCRATCH_BYTES, 64 * max(sizes)), 4 * max(sizes) * max(depths))
    points = []
    with tempfile.TemporaryDirectory(dir=directory, prefix="fallbackgate-engine-io-") as scratch:
        path = pathlib.Path(scratch) / "scratch.bin"
        make_scratch_file(path, file_bytes)
        with IOScheduler(num_workers=num_workers, max_records=1) as io:
            io.start()
            for size in sizes:
                for depth in depths:
                    points.append(_measure_point(io, path, file_bytes, size, depth, reads_per_point))
    misses = measure_engine_misses()
    return {"num_workers": num_workers, "directory": str(directory), "points": points, "misses": misses}


def _measure_point(
    io: IOScheduler, path: pathlib.Path, file_bytes: int, size: int, depth: int, num_reads: int
) -> dict[str, Any]:
    """`num_reads` reads of `size`, `depth` submitted together and waited in order (see the module docstring)."""
    rng = random.Random(f"engine-io/{size}/{depth}")
    buffers = [aligned_buffer(size) for _ in range(depth)]
    slot = torch.empty(size, dtype=torch.uint8)
    slots = (file_bytes - size) // ALIGN + 1
    parts: dict[str, list[float]] = {k: [] for k in ("wait_s", "service_s", "wakeup_s", "checksum_s", "copy_s")}
    totals: list[float] = []
    for _ in range(max(1, num_reads // depth)):
        began = time.monotonic_ns()
        tickets = [
            io.submit_read(path, rng.randrange(slots) * ALIGN, size, ObjectKind.EXPERT, "profile", into=buffer)
            for buffer in buffers
        ]
        for ticket in tickets:
            data = io.wait(ticket)
            returned = time.monotonic_ns()
            record = ticket.record
            t0 = time.perf_counter()
            xxhash.xxh3_64_hexdigest(data)
            t1 = time.perf_counter()
            slot.copy_(torch.frombuffer(data, dtype=torch.uint8))
            t2 = time.perf_counter()
            wait_s = (returned - began) / 1e9
            parts["wait_s"].append(wait_s)
            parts["service_s"].append((record.end_ns - record.start_ns) / 1e9)
            parts["wakeup_s"].append(max(returned - record.end_ns, 0) / 1e9)
            parts["checksum_s"].append(t1 - t0)
            parts["copy_s"].append(t2 - t1)
            totals.append(wait_s + (t2 - t0))
            began = time.monotonic_ns()  # the next read's wait starts after this one's checksum and copy
    point: dict[str, Any] = {"num_bytes": size, "queue_depth": depth, "num_reads": len(totals)}
    point.update({k: statistics.median(v) for k, v in parts.items()})
    point["mean_total_s"] = statistics.fmean(totals)
    return point

"""python -m fallbackgate.bench.io_backends [--dir DIR] [--seconds 1.0] [--json FILE]

Which way to keep several disk reads in flight measures best on this machine: a pool of threads each
calling ``os.preadv`` against an ``O_DIRECT`` descriptor, or one thread driving io_uring through the
``liburing`` package (skipped when it is not installed). Random aligned reads of 64 KiB and 1 MiB at queue
depth 1, 4 and 16 against a scratch file on DIR's file system (written, fsynced and dropped from the page
cache first); per point: reads/s, MB/s, median and p99 latency. The I/O scheduler
(:mod:`fallbackgate.engine.io`) uses the threads: on this 2-core machine neither won consistently (two runs
of 1.5 s per point: io_uring ahead at 64 KiB/QD 4 and 1 MiB/QD 4-16 in one, threads ahead at 64 KiB/QD 16
and 1 MiB/QD 1 in the other), and threads need no extra package.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

from fallbackgate.engine.io.direct import ALIGN, aligned_buffer, make_scratch_file, open_direct

SIZES = (64 << 10, 1 << 20)
DEPTHS = (1, 4, 16)
FILE_BYTES = 256 << 20


def _summary(latencies: list[float], num_bytes: int, elapsed: float) -> dict[str, float]:
    latencies.sort()
    return {
        "reads_per_s": len(latencies) / elapsed,
        "mb_per_s": len(latencies) * num_bytes / elapsed / 1e6,
        "p50_ms": 1e3 * statistics.median(latencies),
        "p99_ms": 1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "num_reads": len(latencies),
    }


def run_threads(path: str, file_bytes: int, num_bytes: int, depth: int, seconds: float) -> dict[str, float]:
    """`depth` threads, each reading `num_bytes` at random aligned offsets with preadv until time is up."""
    fd, _ = open_direct(path)
    slots = (file_bytes - num_bytes) // ALIGN
    latencies: list[float] = []
    lock = threading.Lock()
    stop = time.perf_counter() + seconds

    def worker(seed: int) -> None:
        rng, buffer, own = random.Random(seed), aligned_buffer(num_bytes), []
        while time.perf_counter() < stop:
            offset = rng.randrange(slots) * ALIGN
            start = time.perf_counter()
            os.preadv(fd, [buffer], offset)
            own.append(time.perf_counter() - start)
        with lock:
            latencies.extend(own)

    began = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(depth)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - began
    os.close(fd)
    return _summary(latencies, num_bytes, elapsed)


def run_uring(path: str, file_bytes: int, num_bytes: int, depth: int, seconds: float) -> dict[str, float]:
    """One thread keeping `depth` reads in flight on an io_uring ring."""
    import liburing as lu

    fd, _ = open_direct(path)
    ring, cqe = lu.Ring(), lu.Cqe()
    lu.io_uring_queue_init(max(8, 2 * depth), ring)
    slots = (file_bytes - num_bytes) // ALIGN
    rng = random.Random(0)
    buffers = [aligned_buffer(num_bytes) for _ in range(depth)]
    vectors = [lu.Iovec([memoryview(b)]) for b in buffers]
    started = [0.0] * depth
    latencies: list[float] = []

    def submit(slot: int) -> None:
        sqe = lu.io_uring_get_sqe(ring)
        lu.io_uring_prep_readv(sqe, fd, vectors[slot], rng.randrange(slots) * ALIGN)
        lu.io_uring_sqe_set_data64(sqe, slot)
        started[slot] = time.perf_counter()

    try:
        began = time.perf_counter()
        stop = began + seconds
        for slot in range(depth):
            submit(slot)
        lu.io_uring_submit(ring)
        in_flight = depth
        while in_flight:
            lu.io_uring_wait_cqe(ring, cqe)
            entry = cqe[0]
            slot, res = entry.user_data, entry.res
            lu.io_uring_cqe_seen(ring, entry)
            if res < 0:
                raise OSError(-res, os.strerror(-res))
            latencies.append(time.perf_counter() - started[slot])
            in_flight -= 1
            if time.perf_counter() < stop:
                submit(slot)
                lu.io_uring_submit(ring)
                in_flight += 1
        elapsed = time.perf_counter() - began
    finally:
        lu.io_uring_queue_exit(ring)
        os.close(fd)
    return _summary(latencies, num_bytes, elapsed)


def main(argv: list[str] | None = None) -> int:
    """Entry point: measure both backends and print (and optionally write) the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="directory whose file system is measured (default: $TMPDIR)")
    parser.add_argument("--seconds", type=float, default=1.0, help="seconds per point")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    backends = {"threads+preadv": run_threads}
    try:
        import liburing  # noqa: F401

        backends["io_uring (liburing)"] = run_uring
    except ImportError:
        print("liburing is not installed: io_uring skipped", file=sys.stderr)
    directory = pathlib.Path(args.dir or tempfile.gettempdir())
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=directory, prefix="fallbackgate-iobench-") as scratch:
        path = os.path.join(scratch, "scratch.bin")
        make_scratch_file(path, FILE_BYTES)
        for num_bytes in SIZES:
            for depth in DEPTHS:
                for name, fn in backends.items():
                    row = {"backend": name, "kib": num_bytes // 1024, "depth": depth}
                    row |= fn(path, FILE_BYTES, num_bytes, depth, args.seconds)
                    results.append(row)
                    print(
                        f"{name:20s} {row['kib']:5d} KiB qd {depth:2d}: {row['reads_per_s']:8.0f} reads/s "
                        f"{row['mb_per_s']:8.1f} MB/s  p50 {row['p50_ms']:7.3f} ms  p99 {row['p99_ms']:7.3f} ms"
                    )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"dir": str(directory), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The roofline arithmetic of fallbackgate.bench.scale: min(in-memory rate, tokens / (Belady bytes / best disk rate)),
Belady's MIN counted on the engine's trace, the disk rate the best over queue depths at the read size."""

from __future__ import annotations

import math

from fallbackgate.bench.scale_bound import roofline, roofline_tokens_per_s
from fallbackgate.engine.disk_model import DiskOp, DiskPoint, DiskTable

MIB = 1 << 20


def _point(size: int, depth: int, rate: float) -> DiskPoint:
    return DiskPoint(DiskOp.READ, size, depth, size / rate, 2 * size / rate, rate, depth)


def test_disk_limited_roofline_is_tokens_times_rate_over_bytes() -> None:
    # 64 tokens, 1 GiB Belady must read, 2 GiB/s: 128 tokens/s, below the 500 tokens/s in memory
    assert roofline_tokens_per_s(500.0, 64, 1 << 30, 2.0 * (1 << 30)) == 128.0
    # the in-memory rate caps it when the disk would allow more
    assert roofline_tokens_per_s(100.0, 64, 1 << 30, 2.0 * (1 << 30)) == 100.0
    assert roofline_tokens_per_s(7.0, 64, 0, 1.0) == 7.0  # nothing to read


def test_roofline_counts_belady_misses_at_the_best_depth_of_the_read_size() -> None:
    table = DiskTable(
        (_point(MIB, 1, 100e6), _point(MIB, 32, 400e6), _point(4 * MIB, 1, 300e6), _point(4 * MIB, 16, 900e6)),
        "/x",
        True,
    )
    # two slots; a b c a b c: MIN misses a, b, c, then one of a/b once more (c evicts b, keeping a: a hits,
    # b misses, then c hits) = 4 misses
    trace = [[0, 0], [0, 1], [0, 2], [0, 0], [0, 1], [0, 2]]
    engine = {
        "trace": trace,
        "num_expert_slots": 2,
        "checkpoint_bytes_per_expert": 12 * MIB,
        "expert_io_bytes": 4 * MIB,
        "num_output_tokens": 10,
        "num_expert_disk_reads": 5,
    }
    got = roofline(engine, 1000.0, table)
    assert got["belady_misses"] == 4 and got["lru_misses"] == 6
    assert got["belady_read_bytes"] == 48 * MIB
    assert got["best_read_bytes_per_s"] == 900e6  # depth 16 beats depth 1 at 4 MiB; 1 MiB points unused
    assert math.isclose(got["tokens_per_s"], 10 * 900e6 / (48 * MIB))
    assert math.isclose(roofline(engine, 100.0, table)["tokens_per_s"], 100.0)

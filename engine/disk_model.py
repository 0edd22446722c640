"""The measured disk: latency and bandwidth by operation, transfer size and queue depth.

``fallbackgate profile`` fills a :class:`DiskTable` by keeping `queue_depth` transfers of one size in flight
through the engine's I/O scheduler against a scratch file (``O_DIRECT``: page-cache hits are not disk reads)
and timing each from submission to completion. Predictions interpolate linearly in size (a transfer costs a
fixed part plus bytes over bandwidth) and in log2 of the depth between measured points; beyond the largest
size, time grows in proportion to the bytes; beyond the deepest queue, in proportion to the depth.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import math

MAX_REMEMBERED = 1 << 14  # predictions a table keeps (cleared when full)


class DiskOp(str, enum.Enum):
    """The mix of transfers a table point was measured under."""

    READ = "read"  # reads only
    WRITE = "write"  # writes only
    MIXED = "mixed"  # reads and writes alternating; the point's figures cover both


@dataclasses.dataclass(slots=True, frozen=True)
class DiskPoint:
    """One measured (operation, size, depth): per-transfer latency and the aggregate rate."""

    op: DiskOp  # read, write or mixed
    num_bytes: int  # bytes per transfer
    queue_depth: int  # transfers kept in flight
    latency_s: float  # median seconds from submission to completion of one transfer
    p99_latency_s: float  # 99th percentile of the same
    bytes_per_s: float  # bytes moved per second by all transfers together
    num_transfers: int  # transfers timed

    def __post_init__(self) -> None:
        object.__setattr__(self, "op", DiskOp(self.op))
        if self.num_bytes <= 0 or self.queue_depth <= 0 or not self.latency_s > 0 or not self.bytes_per_s > 0:
            raise ValueError(f"disk point needs positive size, depth, latency and rate: {self}")


@dataclasses.dataclass(frozen=True)
class DiskTable:
    """Every measured point of one disk, with where and how it was measured. Controllers ask it thousands of
    times a step, so the points are indexed by operation, size and depth once and predictions remembered
    (outside the dataclass fields: the table's value, equality and saved form are its points alone)."""

    points: tuple[DiskPoint, ...]  # at least one per operation that is predicted
    directory: str  # the directory whose file system was measured (the spill directory's)
    is_direct: bool  # the page cache was bypassed (O_DIRECT); False: buffered with pages dropped first

    def __post_init__(self) -> None:
        points = tuple(p if isinstance(p, DiskPoint) else DiskPoint(**p) for p in self.points)
        object.__setattr__(self, "points", points)
        if not points:
            raise ValueError("a disk table needs at least one measured point")
        object.__setattr__(self, "_by_op", {})  # op -> (sizes, size -> (depths, depth -> point))
        object.__setattr__(self, "_predicted", {})  # (op, bytes, depth, is_latency) -> seconds

    def read_s(self, num_bytes: int, queue_depth: int = 1) -> float:
        """Predicted seconds from submission to arrival of one read of `num_bytes` that finds
        `queue_depth` transfers (itself included) sharing the disk."""
        return self._predict(DiskOp.READ, num_bytes, queue_depth, is_latency=True)

    def write_s(self, num_bytes: int, queue_depth: int = 1) -> float:
        """Predicted seconds from submission to completion of one write (as :meth:`read_s`)."""
        return self._predict(DiskOp.WRITE, num_bytes, queue_depth, is_latency=True)

    def read_busy_s(self, num_bytes: int, queue_depth: int = 1) -> float:
        """Seconds of the disk's time one read of `num_bytes` takes when `queue_depth` transfers share it:
        its bytes over the aggregate rate at that depth (what queued transfers add up to)."""
        return self._predict(DiskOp.READ, num_bytes, queue_depth, is_latency=False)

    def best_read_bytes_per_s(self, num_bytes: int) -> float:
        """The best measured read rate at the size nearest `num_bytes`, over every depth."""
        sizes = self._sizes(DiskOp.READ)
        size = min(sizes, key=lambda s: abs(math.log2(s) - math.log2(max(1, num_bytes))))
        return max(p.bytes_per_s for p in self._of(DiskOp.READ) if p.num_bytes == size)

    def _of(self, op: DiskOp) -> list[DiskPoint]:
        chosen = [p for p in self.points if p.op is op] or [p for p in self.points if p.op is DiskOp.MIXED]
        if not chosen:
            raise ValueError(f"the disk table has no {op.value} points")
        return chosen

    def _indexed(self, op: DiskOp) -> tuple[list[int], dict[int, tuple[list[int], dict[int, DiskPoint]]]]:
        """The points of `op` (as :meth:`_of` chooses them) by size, then depth: sorted sizes, and per size
        its sorted depths and the point at each."""
        index = self._by_op.get(op)  # type: ignore[attr-defined]
        if index is None:
            by_size: dict[int, dict[int, DiskPoint]] = {}
            for p in self._of(op):
                by_size.setdefault(p.num_bytes, {})[p.queue_depth] = p
            index = (sorted(by_size), {size: (sorted(d), d) for size, d in by_size.items()})
            self._by_op[op] = index  # type: ignore[attr-defined]
        return index

    def _sizes(self, op: DiskOp) -> list[int]:
        return self._indexed(op)[0]

    def _predict(self, op: DiskOp, num_bytes: int, queue_depth: int, is_latency: bool) -> float:
        if num_bytes <= 0:
            return 0.0
        key = (op, num_bytes, queue_depth, is_latency)
        predicted: dict = self._predicted  # type: ignore[attr-defined]
        seconds = predicted.get(key)
        if seconds is None:
            if len(predicted) >= MAX_REMEMBERED:
                predicted.clear()
            seconds = predicted[key] = self._interpolate(op, num_bytes, queue_depth, is_latency)
        return seconds

    def _interpolate(self, op: DiskOp, num_bytes: int, queue_depth: int, is_latency: bool) -> float:
        low, high = _bracket(self._sizes(op), num_bytes)
        at_low = self._at_size(op, low, queue_depth, is_latency)
        if low == high:  # a measured size, or beyond either end: the fixed cost below, the bytes above
            return at_low * num_bytes / low if num_bytes > low else at_low
        at_high = self._at_size(op, high, queue_depth, is_latency)
        return at_low + (at_high - at_low) * (num_bytes - low) / (high - low)

    def _at_size(self, op: DiskOp, num_bytes: int, queue_depth: int, is_latency: bool) -> float:
        """Seconds at a measured size, interpolated in log2(depth) between measured depths."""
        depths, by_depth = self._indexed(op)[1][num_bytes]
        depth = max(1, queue_depth)

        def value(d: int) -> float:
            point = by_depth[d]
            return point.latency_s if is_latency else num_bytes / point.bytes_per_s

        low, high = _bracket(depths, depth)
        if low == high:  # a measured depth, or beyond either end (deeper: waits behind the others)
            return value(low) * (depth / low if is_latency and depth > low else 1.0)
        frac = (math.log2(depth) - math.log2(low)) / (math.log2(high) - math.log2(low))
        return value(low) + (value(high) - value(low)) * frac


def _bracket(values: list[int], x: int) -> tuple[int, int]:
    """The measured values at or just below and at or just above `x` (clamped to the ends)."""
    i = bisect.bisect_left(values, x)
    if i < len(values) and values[i] == x:
        return x, x
    return values[max(0, i - 1)], values[min(len(values) - 1, i)]

"""What the I/O scheduler queues and reports: one record per read or write, and read-only snapshots.

Times are ``time.monotonic_ns()``; a record's fields are filled as it moves from queued to in flight to
done. Snapshots copy what a controller may see (frozen, plain values), never the scheduler's own records.
"""

from __future__ import annotations

import dataclasses
import enum

from fallbackgate.engine.tags import ObjectKind


class IOOp(str, enum.Enum):
    """The direction of one transfer between memory and a file."""

    READ = "read"  # file -> memory
    WRITE = "write"  # memory -> file


@dataclasses.dataclass(slots=True)
class IORecord:
    """One read or write: what, where, for whom, and when it was submitted, started and finished."""

    ticket_id: int  # the scheduler's sequence number (submission order)
    op: IOOp  # read or write
    object_kind: ObjectKind  # expert or kv_block
    object_id: str  # the object's id as its owner spells it ("layer:expert", "request:layer:block", ...)
    path: str  # file read or written
    offset: int  # byte offset in the file
    num_bytes: int  # bytes asked for
    requester_ids: tuple[str, ...]  # requests waiting on this transfer (empty: the engine's own, e.g. prefetch)
    priority: int  # lower is served first (the caller's, as its controller ordered); FIFO within one
    submit_ns: int  # when it was queued
    queue_depth_at_submit: int  # transfers queued or in flight when it was queued (itself excluded)
    start_ns: int = 0  # when a worker began it (0: still queued)
    end_ns: int = 0  # when it finished (0: not yet)
    num_bytes_done: int = 0  # bytes actually transferred
    is_direct: bool = False  # went around the page cache (O_DIRECT); False: buffered
    error: str = ""  # why it failed ("" when it did not)

    @property
    def wait_s(self) -> float:
        """Seconds spent queued before a worker took it."""
        return max(0, self.start_ns - self.submit_ns) / 1e9 if self.start_ns else 0.0

    @property
    def service_s(self) -> float:
        """Seconds from start to finish (the device's latency at the depth it met)."""
        return max(0, self.end_ns - self.start_ns) / 1e9 if self.end_ns else 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class IOEntry:
    """One queued or in-flight transfer as a controller sees it."""

    ticket_id: int  # submission order
    op: IOOp  # read or write
    object_kind: ObjectKind  # expert or kv_block
    object_id: str  # the object's id
    num_bytes: int  # bytes to move
    requester_ids: tuple[str, ...]  # requests waiting on it
    priority: int  # serving order (lower first)
    submit_ns: int  # when it was queued
    start_ns: int  # when it started (0: queued)


@dataclasses.dataclass(frozen=True, slots=True)
class IOSnapshot:
    """The scheduler's queue at one instant: what is in flight, what waits, and for whom."""

    taken_ns: int  # when the snapshot was taken
    num_workers: int  # transfers that can be in flight at once
    in_flight: tuple[IOEntry, ...]  # started, not finished
    queued: tuple[IOEntry, ...]  # waiting for a worker, in serving order
    num_completed: int  # transfers finished since the scheduler started
    num_bytes_read: int  # bytes read since the scheduler started
    num_bytes_written: int  # bytes written since the scheduler started

    @property
    def depth(self) -> int:
        """Transfers queued or in flight (what a new one would queue behind)."""
        return len(self.in_flight) + len(self.queued)

    @property
    def queued_bytes(self) -> int:
        """Bytes still to move: queued plus in flight."""
        return sum(e.num_bytes for e in self.in_flight) + sum(e.num_bytes for e in self.queued)

    def requester_bytes(self, request_id: str) -> int:
        """Bytes queued or in flight that `request_id` waits on."""
        return sum(e.num_bytes for e in (*self.in_flight, *self.queued) if request_id in e.requester_ids)


EMPTY_SNAPSHOT = IOSnapshot(0, 0, (), (), 0, 0, 0)
"""The snapshot of an engine that has no I/O scheduler (or one that never ran)."""

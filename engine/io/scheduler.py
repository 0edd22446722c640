"""The one I/O scheduler: every disk read and write of experts and KV blocks queues here, so transfers of both
kinds compete for the same device and a controller can see the queue.

A small pool of worker threads serves the queue in (priority, submission) order with ``os.preadv`` /
``os.pwritev`` (the GIL is released while the kernel works, so workers overlap each other and compute).
Threads were chosen by measurement against io_uring (``python -m fallbackgate.bench.io_backends``): on this
2-core machine neither wins consistently at queue depths 1-16. Reads go around the page cache with
``O_DIRECT``: an unaligned offset or length reads the aligned range around it into a bounce buffer. A
file system that refuses ``O_DIRECT`` is read buffered, and the record says so (``is_direct``).

The scheduler is mechanism: callers set each transfer's priority as their controller ordered them.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import heapq
import os
import threading
import time
from collections.abc import Sequence

from fallbackgate.engine.io.direct import ALIGN, open_direct
from fallbackgate.engine.io.requests import IOEntry, IOOp, IORecord, IOSnapshot
from fallbackgate.engine.io.transfer import Bounce, Buffer, read_into, write_from
from fallbackgate.engine.tags import ObjectKind


class IOSchedulerError(RuntimeError):
    """A transfer failed or the scheduler was used after close; the message names the file and offset."""


@dataclasses.dataclass(slots=True, eq=False)
class Ticket:
    """A submitted transfer: its record (filled as it runs) and, once done, a read's bytes."""

    record: IORecord  # what was asked for and when it ran
    buffer: Buffer | None  # a read's destination (None: the scheduler allocates) or a write's source
    is_direct_wanted: bool  # go around the page cache where the file system allows it
    done: threading.Event = dataclasses.field(default_factory=threading.Event)  # set when finished or failed
    data: memoryview | None = None  # a read's bytes (a view of `buffer` or of the scheduler's allocation)


class IOScheduler:
    """A queue of reads and writes served by `num_workers` threads (started on first use).

    ``max_records`` bounds the log of finished transfers kept for :meth:`take_completed` (oldest dropped).
    """

    def __init__(self, num_workers: int = 4, max_records: int = 1 << 16) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self._lock = threading.Condition()
        self._heap: list[tuple[int, int, Ticket]] = []
        self._in_flight: dict[int, Ticket] = {}
        self._completed: collections.deque[IORecord] = collections.deque(maxlen=max_records)
        self._fds: dict[tuple[str, bool, bool], tuple[int, bool]] = {}
        self._retired: dict[str, list[int]] = {}  # direct descriptors replaced by buffered ones, by path
        self._threads: list[threading.Thread] = []
        self._next_id = 0
        self._is_closed = False
        self.num_completed = self.num_bytes_read = self.num_bytes_written = 0
        self.num_records_dropped = 0  # finished records that fell off the bounded log

    # --- submitting ------------------------------------------------------------------------------
    def submit_read(
        self,
        path: str | os.PathLike[str],
        offset: int,
        num_bytes: int,
        kind: ObjectKind,
        object_id: str,
        requester_ids: Sequence[str] = (),
        *,
        into: Buffer | None = None,
        priority: int = 0,
        direct: bool = True,
    ) -> Ticket:
        """Queue a read of `num_bytes` at `offset` of `path` (into `into` when given: at least that long)."""
        if into is not None and memoryview(into).nbytes < num_bytes:
            raise ValueError(f"read of {num_bytes} bytes into a buffer of {memoryview(into).nbytes}")
        return self._submit(IOOp.READ, path, offset, num_bytes, kind, object_id, requester_ids, into, priority, direct)

    def submit_write(
        self,
        path: str | os.PathLike[str],
        offset: int,
        data: Buffer | bytes,
        kind: ObjectKind,
        object_id: str,
        requester_ids: Sequence[str] = (),
        *,
        priority: int = 0,
        direct: bool = True,
    ) -> Ticket:
        """Queue a write of `data` at `offset` of `path` (created when missing). `data` must stay unchanged
        until the write is done."""
        view = memoryview(data).cast("B")
        num_bytes = view.nbytes
        return self._submit(IOOp.WRITE, path, offset, num_bytes, kind, object_id, requester_ids, view, priority, direct)

    def _submit(
        self,
        op: IOOp,
        path: str | os.PathLike[str],
        offset: int,
        num_bytes: int,
        kind: ObjectKind,
        object_id: str,
        requester_ids: Sequence[str],
        buffer: Buffer | None,
        priority: int,
        direct: bool,
    ) -> Ticket:
        if offset < 0 or num_bytes <= 0:
            raise ValueError(f"{op.value} of {num_bytes} bytes at offset {offset} of {path}: both must be positive")
        with self._lock:
            if self._is_closed:
                raise IOSchedulerError(f"{op.value} of {path} submitted after the I/O scheduler closed")
            self._start_workers()
            record = IORecord(
                self._next_id,
                op,
                ObjectKind(kind),
                str(object_id),
                os.fspath(path),
                int(offset),
                int(num_bytes),
                tuple(requester_ids),
                int(priority),
                time.monotonic_ns(),
                len(self._heap) + len(self._in_flight),
            )
            self._next_id += 1
            ticket = Ticket(record, buffer, direct)
            heapq.heappush(self._heap, (record.priority, record.ticket_id, ticket))
            self._lock.notify()
        return ticket

    # --- waiting ---------------------------------------------------------------------------------
    def wait(self, ticket: Ticket, timeout_s: float | None = None) -> memoryview | None:
        """Block until `ticket` is done; a read's bytes (exactly `num_bytes`), None for a write. A failed
        transfer raises :class:`IOSchedulerError` naming it."""
        if not ticket.done.wait(timeout_s):
            raise TimeoutError(f"{ticket.record.op.value} of {ticket.record.path} not done after {timeout_s} s")
        if ticket.record.error:
            r = ticket.record
            raise IOSchedulerError(f"{r.op.value} of {r.num_bytes} bytes at {r.offset} of {r.path}: {r.error}")
        return ticket.data

    def cancel(self, ticket: Ticket) -> bool:
        """Take a still-queued transfer off the queue; False when it already started (it then finishes)."""
        with self._lock:
            for i, (_, _, queued) in enumerate(self._heap):
                if queued is ticket:
                    self._heap.pop(i)
                    heapq.heapify(self._heap)
                    ticket.record.error = "cancelled"
                    ticket.done.set()
                    return True
        return False

    # --- what a controller sees ------------------------------------------------------------------
    def snapshot(self) -> IOSnapshot:
        """The queue now: in flight, queued in serving order, and for whom."""
        with self._lock:
            in_flight = tuple(_entry(t.record) for t in sorted(self._in_flight.values(), key=_order))
            queued = tuple(_entry(t.record) for _, _, t in sorted(self._heap))
            return IOSnapshot(
                time.monotonic_ns(),
                self.num_workers,
                in_flight,
                queued,
                self.num_completed,
                self.num_bytes_read,
                self.num_bytes_written,
            )

    def take_completed(self) -> list[IORecord]:
        """Finished (or failed) transfers since the last call, in completion order."""
        with self._lock:
            records = list(self._completed)
            self._completed.clear()
        return records

    # --- lifetime --------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the workers now rather than on the first submission (so a timing does not include it)."""
        with self._lock:
            if not self._is_closed:
                self._start_workers()

    def forget_file(self, path: str | os.PathLike[str]) -> None:
        """Close the descriptors kept for `path` (before it is removed or replaced)."""
        name = os.fspath(path)
        with self._lock:
            for key in [k for k in self._fds if k[0] == name]:
                os.close(self._fds.pop(key)[0])
            for fd in self._retired.pop(name, []):
                os.close(fd)

    def close(self) -> None:
        """Finish what is in flight, fail what is queued, stop the workers and close every descriptor."""
        with self._lock:
            self._is_closed = True
            for _, _, ticket in self._heap:
                ticket.record.error = "I/O scheduler closed before it ran"
                ticket.done.set()
            self._heap.clear()
            self._lock.notify_all()
        for thread in self._threads:
            thread.join()
        with self._lock:
            for fd, _ in self._fds.values():
                os.close(fd)
            for fd in (fd for fds in self._retired.values() for fd in fds):
                os.close(fd)
            self._fds.clear()
            self._retired.clear()

    def __enter__(self) -> IOScheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- workers ---------------------------------------------------------------------------------
    def _start_workers(self) -> None:
        while len(self._threads) < self.num_workers:
            thread = threading.Thread(target=self._work, name=f"fallbackgate-io-{len(self._threads)}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def _work(self) -> None:
        bounce = Bounce()
        while True:
            with self._lock:
                while not self._heap and not self._is_closed:
                    self._lock.wait()
                if not self._heap:
                    return
                _, _, ticket = heapq.heappop(self._heap)
                ticket.record.start_ns = time.monotonic_ns()
                self._in_flight[ticket.record.ticket_id] = ticket
            try:
                self._run(ticket, bounce)
            except Exception as exc:  # noqa: BLE001 - the fault stays with its transfer; the worker goes on
                ticket.record.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            self._finish(ticket)

    def _run(self, ticket: Ticket, bounce: Bounce) -> None:
        """One transfer in a worker. A file system that opens ``O_DIRECT`` but refuses the read (EINVAL) is
        read buffered from then on; a buffered write that wanted ``O_DIRECT`` is flushed and its pages
        dropped, so reading it back comes from the device too."""
        r = ticket.record
        if r.op is IOOp.READ:
            fd, is_direct = self._fd(r.path, False, ticket.is_direct_wanted)
            try:
                ticket.data = read_into(fd, is_direct, r, ticket.buffer, bounce)
            except OSError as exc:
                if not is_direct or exc.errno != errno.EINVAL:
                    raise
                fd, is_direct = self._refuse_direct(r.path)
                ticket.data = read_into(fd, is_direct, r, ticket.buffer, bounce)
            return
        is_aligned = r.offset % ALIGN == 0 and r.num_bytes % ALIGN == 0
        fd, is_direct = self._fd(r.path, True, ticket.is_direct_wanted and is_aligned)
        write_from(fd, is_direct, r, memoryview(ticket.buffer).cast("B"), bounce)
        if ticket.is_direct_wanted and not is_direct:
            os.fdatasync(fd)
            os.posix_fadvise(fd, r.offset, r.num_bytes, os.POSIX_FADV_DONTNEED)

    def _refuse_direct(self, path: str) -> tuple[int, bool]:
        """Serve `path`'s direct reads with a buffered descriptor from now on (the direct one stays open until
        the file is forgotten: another worker may be using it)."""
        with self._lock:
            key = (path, False, True)
            opened = self._fds.get(key)
            if opened is not None and opened[1]:
                self._retired.setdefault(path, []).append(opened[0])
                self._fds[key] = _open_buffered(path, False)
            return self._fds[key]

    def _finish(self, ticket: Ticket) -> None:
        record = ticket.record
        record.end_ns = time.monotonic_ns()
        with self._lock:
            self._in_flight.pop(record.ticket_id, None)
            if len(self._completed) == self._completed.maxlen:
                self.num_records_dropped += 1
            self._completed.append(record)
            self.num_completed += 1
            if not record.error:
                if record.op is IOOp.READ:
                    self.num_bytes_read += record.num_bytes_done
                else:
                    self.num_bytes_written += record.num_bytes_done
        ticket.done.set()

    def _fd(self, path: str, is_write: bool, direct: bool) -> tuple[int, bool]:
        key = (path, is_write, direct)
        with self._lock:
            if key not in self._fds:
                opened = open_direct(path, is_write, create=is_write) if direct else _open_buffered(path, is_write)
                self._fds[key] = opened
            return self._fds[key]


def _open_buffered(path: str, is_write: bool) -> tuple[int, bool]:
    flags = os.O_RDWR | os.O_CREAT if is_write else os.O_RDONLY
    return os.open(path, flags, 0o600), False


def _order(ticket: Ticket) -> tuple[int, int]:
    return ticket.record.priority, ticket.record.ticket_id


def _entry(record: IORecord) -> IOEntry:
    return IOEntry(
        record.ticket_id,
        record.op,
        record.object_kind,
        record.object_id,
        record.num_bytes,
        record.requester_ids,
        record.priority,
        record.submit_ns,
        record.start_ns,
    )

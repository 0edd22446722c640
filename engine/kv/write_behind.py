"""Spill writes nobody waits for yet: prepared during a step's end, queued together, finished before the next
step starts.

A :class:`~fallbackgate.engine.kv.spill.SpillDir` writing behind keeps each write's aligned source buffer here
until the write is done (``O_DIRECT`` reads the buffer while it runs). The writes are queued at once after the
Python work of all of them, so the I/O workers do not wake between blocks and contend with that work for the
interpreter. A record whose write is still in flight is settled (waited for) before it is read or its extent
is freed. A write that failed is reported where it is settled, as a synchronous write's failure would have
been at once (:class:`WriteFailed`).
"""

from __future__ import annotations

import dataclasses
import mmap
import pathlib
from collections.abc import Callable

from fallbackgate.engine.io import IOScheduler, IOSchedulerError, Ticket

RecordKey = tuple[pathlib.Path, int]  # a record's segment file and offset


class WriteFailed(OSError):
    """A write behind failed: the name of what it wrote, its size, and why."""

    def __init__(self, name: str, num_bytes: int, why: str) -> None:
        super().__init__(f"{name} ({num_bytes} B: {why})")


@dataclasses.dataclass(slots=True)
class PendingWrite:
    """A spill write prepared, then submitted, and not yet waited for."""

    name: str  # what it writes (for error messages)
    num_bytes: int  # the record's bytes (its buffer is the whole aligned extent)
    submit: Callable[[], Ticket]  # queues it on the I/O scheduler
    buffer: mmap.mmap  # its aligned source bytes, kept alive and unchanged until it is done
    ticket: Ticket | None = None  # its queued transfer (None: not submitted yet)


class WriteBehind:
    """The spill writes held back or in flight."""

    def __init__(self) -> None:
        self.pending: dict[RecordKey, PendingWrite] = {}

    @property
    def num_bytes(self) -> int:
        """Bytes of the source buffers still held (each an aligned extent)."""
        return sum(len(p.buffer) for p in self.pending.values())

    def add(self, key: RecordKey, name: str, num_bytes: int, submit: Callable[[], Ticket], buffer: mmap.mmap) -> None:
        """A write of a `num_bytes` record prepared and held back until :meth:`submit_all`."""
        self.pending[key] = PendingWrite(name, num_bytes, submit, buffer)

    def submit_all(self) -> None:
        """Queue every write held back."""
        for pending in self.pending.values():
            if pending.ticket is None:
                pending.ticket = pending.submit()

    def settle(self, io: IOScheduler | None, key: RecordKey) -> None:
        """Wait for `key`'s write if it is held back or in flight; raises :class:`WriteFailed` if it failed."""
        pending = self.pending.pop(key, None)
        if pending is None or io is None:
            return
        ticket = pending.ticket
        try:
            ticket = ticket if ticket is not None else pending.submit()
            io.wait(ticket)
        except IOSchedulerError as exc:  # a failed write, or a scheduler closed before it was queued
            why = (ticket.record.error if ticket is not None else None) or str(exc)
            raise WriteFailed(pending.name, pending.num_bytes, why) from None

    def finish(self, io: IOScheduler | None) -> None:
        """Wait for every write; raises :class:`WriteFailed` for the first that failed (after waiting for all)."""
        failed: WriteFailed | None = None
        self.submit_all()  # any held back go side by side, not one by one
        for key in list(self.pending):
            try:
                self.settle(io, key)
            except WriteFailed as exc:
                failed = failed or exc
        if failed is not None:
            raise failed

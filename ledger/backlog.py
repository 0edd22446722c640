"""What the ledger writer holds while its database is away: batches already turned into rows, kept in order
until they commit, with their measured size (the bound past which a server stops admitting requests).

Sizes are measured with ``sys.getsizeof`` over each row, its values and, one level down, the items of list,
tuple and dict values (token-id lists, tag counts), plus a stated :data:`OP_BYTES` per queued statement
(run updates, audit-task inserts: a few per request). Only batches that wait after a failed write are
counted; the one batch a healthy writer has in flight (at most ``batch_size`` rows, ``flush_interval_s``) is not.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection

from fallbackgate.ledger.retry import Backoff, Transaction
from fallbackgate.ledger.rows import Rows

Op = Callable[[Connection], None]
OP_BYTES = 2048  # a queued statement (a compiled UPDATE or INSERT and its closure), as counted in the buffer
DEFAULT_BUFFER_BYTES = 256 << 20  # rows held while the ledger is away, at most, before admissions stop


@dataclasses.dataclass(slots=True)
class Batch:
    """Rows and statements written in one transaction."""

    rows: Rows  # table -> rows
    ops: list[Op]  # statements run after the inserts
    num_queued: int  # queue items marked done once this batch commits (what flush() waits on)
    num_bytes: int = 0  # measured size, counted once the batch waits in the backlog
    txn: Transaction | None = None  # the PostgreSQL transaction of its last attempt (None: none obtained)


def _value_bytes(value: Any) -> int:
    size = sys.getsizeof(value)
    if isinstance(value, list | tuple):
        size += sum(sys.getsizeof(v) for v in value)
    elif isinstance(value, dict):
        size += sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in value.items())
    return size


def batch_bytes(batch: Batch) -> int:
    """The measured size of a batch's rows (see the module docstring)."""
    total = OP_BYTES * len(batch.ops)
    for table_rows in batch.rows.values():
        total += sys.getsizeof(table_rows)
        for row in table_rows:
            values = row.values() if isinstance(row, dict) else row
            total += sys.getsizeof(row) + sum(_value_bytes(v) for v in values)
    return total


@dataclasses.dataclass(slots=True)
class BufferState:
    """Where the writer stands with its database (``/health`` and ``/metrics`` report it)."""

    is_retrying: bool  # a write failed on a lost connection and waits to be retried
    buffered_bytes: int  # measured size of the batches waiting
    buffer_bytes: int  # the bound: at or beyond it a server refuses new requests
    num_batches: int  # batches waiting
    outage_s: float  # seconds since the current outage's first failure (0.0: none)
    num_retries: int  # attempts after a failure, since the writer started
    last_error: str | None  # the first line of the last transient error (None: none yet)


class Backlog:
    """Batches waiting for the database, oldest first, and their measured size."""

    def __init__(self, buffer_bytes: int, retry_s: float) -> None:
        if buffer_bytes < 1:
            raise ValueError(f"the ledger buffer must be at least 1 byte, got {buffer_bytes}")
        self.buffer_bytes = buffer_bytes  # the admission bound
        self.batches: collections.deque[Batch] = collections.deque()
        self.num_bytes = 0  # measured size of `batches`
        self.backoff = Backoff(retry_s)
        self.last_error: str | None = None

    def __bool__(self) -> bool:
        return bool(self.batches)

    def keep(self, batch: Batch) -> None:
        """Hold ``batch`` (measured now) behind the others."""
        batch.num_bytes = batch_bytes(batch)
        self.batches.append(batch)
        self.num_bytes += batch.num_bytes

    def pop(self) -> Batch:
        """The oldest batch, written: it leaves the backlog."""
        batch = self.batches.popleft()
        self.num_bytes -= batch.num_bytes
        return batch

    def note_error(self, exc: BaseException) -> None:
        """Remember a transient error's first line."""
        lines = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        self.last_error = lines[0] if lines else type(exc).__name__

    @property
    def is_full(self) -> bool:
        """True when the batches waiting reach the bound."""
        return self.num_bytes >= self.buffer_bytes

    def state(self) -> BufferState:
        """A snapshot (read from other threads: counters only, no locks)."""
        return BufferState(
            is_retrying=bool(self.batches),
            buffered_bytes=self.num_bytes,
            buffer_bytes=self.buffer_bytes,
            num_batches=len(self.batches),
            outage_s=self.backoff.outage_s,
            num_retries=self.backoff.num_retries,
            last_error=self.last_error,
        )

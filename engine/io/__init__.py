"""Disk I/O: one scheduler every expert and KV read or write goes through, and page-cache-free file access."""

from fallbackgate.engine.io.context import IOContext, IOPriority, current_io_context, io_context
from fallbackgate.engine.io.requests import EMPTY_SNAPSHOT, IOEntry, IOOp, IORecord, IOSnapshot
from fallbackgate.engine.io.scheduler import IOScheduler, IOSchedulerError, Ticket

__all__ = [
    "EMPTY_SNAPSHOT",
    "IOContext",
    "IOEntry",
    "IOOp",
    "IOPriority",
    "IORecord",
    "IOScheduler",
    "IOSchedulerError",
    "IOSnapshot",
    "Ticket",
    "current_io_context",
    "io_context",
]

"""Disk I/O: one scheduler every expert and KV read or write goes through, and page-cache-free file access."""

from fallbackgate.engine.io.requests import EMPTY_SNAPSHOT, IOEntry, IOOp, IORecord, IOSnapshot
from fallbackgate.engine.io.scheduler import IOScheduler, IOSchedulerError, Ticket

__all__ = ["EMPTY_SNAPSHOT", "IOEntry", "IOOp", "IORecord", "IOScheduler", "IOSchedulerError", "IOSnapshot", "Ticket"]

"""Experts whose checkpoint bytes cannot be read correctly: retried once, then quarantined.

A read that fails its manifest checksum or the read itself (``OSError``, EIO; a shard cut short) is tried
once more: a transient fault clears and the expert is served exactly (the note says so). When the second
read fails too, the expert is quarantined for the life of the process: the record keeps the files and
tensors it is read from, the manifest's xxh3-64 and what was read. No later read of it is attempted; the
requests that need it are told (:class:`ExpertQuarantined`), and the rest of the engine keeps serving.
Serving, read-ahead threads and the audit's own reads share one :class:`Quarantine` (the reader's).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from fallbackgate.engine.errors import CheckpointError, EngineError, ExpertReadError
from fallbackgate.engine.experts.weights import ExpertWeights, HeldWeights

ExpertKey = tuple[int, int]
READ_FAULTS = (ExpertReadError, OSError, CheckpointError)  # what a read of an expert's bytes can fail with


@dataclasses.dataclass(frozen=True, slots=True)
class QuarantineRecord:
    """One quarantined expert and why."""

    key: ExpertKey  # (layer, expert id)
    tensors: dict[str, str]  # tensor name -> file it is read from
    expected: str  # the manifest's xxh3-64
    found: str | None  # xxh3-64 of the bytes the last read gave (None: the read itself failed)
    error: str  # the last read's error
    wall_time: float  # when it was quarantined (time.time())

    @property
    def object_id(self) -> str:
        """The expert as the ledger names it ("2:0")."""
        return f"{self.key[0]}:{self.key[1]}"

    @property
    def summary(self) -> str:
        """One line for request errors and event notes."""
        found = f"read {self.found}" if self.found else "unreadable"
        return f"expert {self.object_id} ({found}, manifest {self.expected})"


class ExpertQuarantined(EngineError):
    """A request needs an expert that is quarantined: it cannot be served exactly."""

    def __init__(self, record: QuarantineRecord) -> None:
        super().__init__(f"quarantined: {record.summary}")
        self.record = record


class Quarantine:
    """The process's quarantined experts (thread-safe: read-ahead threads and audits record here too)."""

    def __init__(self) -> None:
        self._records: dict[ExpertKey, QuarantineRecord] = {}
        self._lock = threading.Lock()
        self.num_retried = 0  # reads that failed once and were tried again
        self.num_cleared = 0  # of which the second read matched the manifest

    def get(self, key: ExpertKey) -> QuarantineRecord | None:
        """The record of `key`, None when it is not quarantined."""
        return self._records.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._records

    def __len__(self) -> int:
        return len(self._records)

    def records(self) -> list[QuarantineRecord]:
        """Every record, in the order they were made."""
        with self._lock:
            return list(self._records.values())

    def add(self, record: QuarantineRecord) -> QuarantineRecord:
        """Quarantine `record.key` (the first record of a key is kept)."""
        with self._lock:
            return self._records.setdefault(record.key, record)


W = TypeVar("W")


class CheckedReader(Protocol):
    """What `read_checked` needs of an ExpertReader."""

    quarantine: Quarantine
    digests: dict[ExpertKey, str]

    def read(self, key: ExpertKey) -> ExpertWeights: ...

    def read_stored(self, key: ExpertKey) -> HeldWeights: ...

    def tensor_files(self, key: ExpertKey) -> dict[str, str]: ...


def _record(reader: CheckedReader, key: ExpertKey, exc: BaseException) -> QuarantineRecord:
    tensors = reader.tensor_files(key)
    expected = reader.digests[key]
    found = exc.found if isinstance(exc, ExpertReadError) else None
    return QuarantineRecord(key, tensors, expected, found, f"{type(exc).__name__}: {exc}", time.time())


def read_checked(reader: CheckedReader, key: ExpertKey) -> tuple[ExpertWeights, str]:
    """Read expert `key` through `reader` (an ExpertReader) verified, retrying once after a fault; returns
    (weights in the compute dtype, note). Raises ExpertQuarantined when it is (or now becomes) quarantined."""
    return _read_checked(reader, key, reader.read)


def read_checked_stored(reader: CheckedReader, key: ExpertKey) -> tuple[HeldWeights, str]:
    """`read_checked`, the weights as held (FP8: codes and scales as stored, see `ExpertReader.read_stored`)."""
    return _read_checked(reader, key, reader.read_stored)


def _read_checked(reader: CheckedReader, key: ExpertKey, read: Callable[[ExpertKey], W]) -> tuple[W, str]:
    quarantine = reader.quarantine
    known = quarantine.get(key)
    if known is not None:
        raise ExpertQuarantined(known)
    try:
        return read(key), ""
    except READ_FAULTS as first:
        quarantine.num_retried += 1
        try:
            weights = read(key)
        except READ_FAULTS as second:
            raise ExpertQuarantined(quarantine.add(_record(reader, key, second))) from second
        quarantine.num_cleared += 1
        kind = "checksum failure" if isinstance(first, ExpertReadError) else "read error"
        return weights, f"{kind} ({first}); a re-read from the checkpoint matched the manifest"

"""The disk tier: tensors written at offsets into a few large segment files, one CRC32 per page.

A SpillDir owns one directory ``fallbackgate-spill-<pid>-<id>`` under its parent and holds an exclusive
``flock`` on the ``.lock`` file inside it while it lives. Its records are extents of segment files
(``seg-<n>.bin``, each at most `segment_bytes`) allocated by size: a freed extent is reused by the next
write of the same size (KV blocks and their quantized parts come in a handful of sizes), so a long run
keeps a few files, not one per block. In an engine every write and read goes through its I/O scheduler
(:meth:`SpillDir.attach_io`): extents are then 4 KiB aligned and written and read with ``O_DIRECT``, so a
block read back comes from the device, never from the page cache (where the file system refuses
``O_DIRECT``, written pages are flushed and dropped). Inside :meth:`SpillDir.writing_behind` writes are
queued and not waited for (:mod:`~fallbackgate.engine.kv.write_behind`) until :meth:`SpillDir.finish_writes`,
or until their record is read or freed. The directory is removed on `close`, when the object is collected,
at interpreter exit, and, after a crash, by the next SpillDir opened under the same parent: a directory
whose lock nobody holds belongs to no live process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import os
import pathlib
import shutil
import uuid
import weakref
import zlib
from collections.abc import Iterator

import numpy as np
import torch

from fallbackgate.engine.errors import ChecksumError, EngineError
from fallbackgate.engine.io import IOContext, IOPriority, IOScheduler, IOSchedulerError, Ticket, current_io_context
from fallbackgate.engine.io.direct import ALIGN, aligned_buffer, round_up
from fallbackgate.engine.kv.write_behind import WriteBehind, WriteFailed
from fallbackgate.engine.tags import ObjectKind

PAGE_BYTES = 64 * 1024
SEGMENT_BYTES = 256 * 1024 * 1024  # one segment file's size at most
DIR_PREFIX = "fallbackgate-spill-"
LOCK_NAME = ".lock"


@dataclasses.dataclass(slots=True)
class PendingRead:
    """A spill record's read, submitted and not yet finished."""

    record: SpillRecord  # what is read
    raw: torch.Tensor  # uint8 destination of the record's bytes
    ticket: Ticket | None  # its queued transfer (None: read in this thread when finished)
    ctx: IOContext  # whom it is for (its finish is noted there)


@dataclasses.dataclass(slots=True, frozen=True)
class SpillRecord:
    """Where a spilled tensor lives and how to check it."""

    path: pathlib.Path  # segment file holding the raw bytes
    offset: int  # byte offset of the tensor in that file
    dtype: torch.dtype  # element type
    shape: tuple[int, ...]  # tensor shape
    page_crcs: tuple[int, ...]  # CRC32 of each PAGE_BYTES page, in order

    @property
    def num_bytes(self) -> int:
        return int(np.prod(self.shape)) * torch.empty((), dtype=self.dtype).element_size()


def remove_stale(parent: pathlib.Path) -> list[pathlib.Path]:
    """Remove spill directories under `parent` that no live SpillDir holds (a crashed process's); returns
    the directories removed."""
    removed = []
    for candidate in parent.glob(f"{DIR_PREFIX}*"):
        lock = candidate / LOCK_NAME
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:  # no lock file: an older layout or a directory being made; old enough ones go
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # a live process holds it
            continue
        shutil.rmtree(candidate, ignore_errors=True)
        os.close(fd)
        removed.append(candidate)
    return removed


def _close_dir(
    root: pathlib.Path, fds: list[int], lock_fd: int, paths: list[pathlib.Path], io_box: list[IOScheduler]
) -> None:
    for io in io_box:  # the scheduler's descriptors go before the files do
        for path in paths:
            io.forget_file(path)
    for fd in fds:
        os.close(fd)
    fds.clear()
    shutil.rmtree(root, ignore_errors=True)
    os.close(lock_fd)


class SpillDir:
    """Writes and reads tensors at offsets in a few segment files; every read verifies every page."""

    def __init__(
        self, parent: str | os.PathLike[str], max_bytes: int | None = None, segment_bytes: int = SEGMENT_BYTES
    ) -> None:
        """Files go into a fresh ``fallbackgate-spill-<pid>-<id>`` directory under `parent` (stale ones of
        dead processes are removed first). `max_bytes` caps the bytes the segment files may hold (None: 90 %
        of the free space on the parent's file system now)."""
        parent = pathlib.Path(parent)
        self.removed_stale = remove_stale(parent) if parent.is_dir() else []
        name = f"{DIR_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.root = parent / name
        making = parent / f".{name}"  # locked before it takes a name another start's cleanup looks at
        try:
            making.mkdir(parents=True, exist_ok=False)
            lock_fd = os.open(making / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            making.rename(self.root)
        except OSError as exc:
            raise EngineError(f"spill directory {parent} is not writable: {exc}") from exc
        self.max_bytes = int(0.9 * shutil.disk_usage(self.root).free) if max_bytes is None else int(max_bytes)
        self.segment_bytes = int(segment_bytes)
        self.paths: list[pathlib.Path] = []  # segment files in creation order
        self._io_box: list[IOScheduler] = []  # the attached scheduler, for the finalizer (forgets its files)
        self.fds: list[int] = []  # their open descriptors
        self.ends: list[int] = []  # bytes allocated at each segment's end so far
        self.free_extents: dict[int, list[tuple[int, int]]] = {}  # size -> (segment, offset) extents to reuse
        self.num_live_bytes = 0  # bytes of records written and not deleted
        self.num_written_bytes = 0  # bytes written, ever
        self.num_read_bytes = 0  # bytes read, ever
        self._finalizer = weakref.finalize(self, _close_dir, self.root, self.fds, lock_fd, self.paths, self._io_box)
        self.is_checksum_verified = True  # tests turn this off to plant a fault
        self.io: IOScheduler | None = None  # the engine's disk queue (None: read and write in this thread)
        self.extent_align = 1  # extents' alignment (ALIGN once an I/O scheduler is attached)
        self.behind = WriteBehind()  # writes held back or queued inside `writing_behind`, not yet waited for
        self.is_writing_behind = False

    @property
    def num_file_bytes(self) -> int:
        """Bytes the segment files span (live and reusable extents)."""
        return sum(self.ends)

    def close(self) -> None:
        """Finish the writes in flight, close the files and remove the directory and everything in it."""
        with contextlib.suppress(WriteFailed):  # what they wrote goes with the directory
            self.behind.finish(self.io)
        self._finalizer()

    @contextlib.contextmanager
    def writing_behind(self) -> Iterator[None]:
        """Writes inside are queued and not waited for (only through an I/O scheduler): their source
        buffers (:attr:`num_pending_bytes`) are held until :meth:`finish_writes` or until their record is
        read or freed."""
        was, self.is_writing_behind = self.is_writing_behind, self.io is not None
        try:
            yield
        finally:
            self.is_writing_behind = was
            if not was:  # the outermost: every write held back goes now
                self.behind.submit_all()

    @property
    def num_pending_bytes(self) -> int:
        """Bytes of the source buffers of writes still in flight."""
        return self.behind.num_bytes

    def finish_writes(self) -> None:
        """Wait for every write in flight; a failed one raises :class:`EngineError` naming the directory, the
        object and why, as a write waited for at once does."""
        try:
            self.behind.finish(self.io)
        except WriteFailed as exc:
            raise EngineError(f"spill directory {self.root.parent}: cannot write {exc}") from None

    def attach_io(self, io: IOScheduler) -> None:
        """Send every write and read through `io` from now on (before anything is written): extents are
        then aligned to :data:`ALIGN` so transfers go around the page cache with ``O_DIRECT``."""
        if self.num_file_bytes:
            raise EngineError("the I/O scheduler must be attached to a spill directory before its first write")
        self.io, self.extent_align = io, ALIGN
        self._io_box[:] = [io]

    def _extent_bytes(self, num_bytes: int) -> int:
        return round_up(num_bytes, self.extent_align)

    def _allocate(self, num_bytes: int) -> tuple[int, int]:
        num_bytes = self._extent_bytes(num_bytes)
        extents = self.free_extents.get(num_bytes)
        if extents:
            return extents.pop()
        if self.num_file_bytes + num_bytes > self.max_bytes:
            raise EngineError(
                f"spill directory {self.root.parent}: cannot write {num_bytes} B, its cap of {self.max_bytes} B is "
                f"reached ({self.num_live_bytes} B live)"
            )
        if not self.fds or self.ends[-1] + num_bytes > self.segment_bytes:
            path = self.root / f"seg-{len(self.paths)}.bin"
            self.fds.append(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
            self.paths.append(path)
            self.ends.append(0)
        offset = self.ends[-1]
        self.ends[-1] += num_bytes
        return len(self.fds) - 1, offset

    def write(self, name: str, tensor: torch.Tensor) -> SpillRecord:
        """Write `tensor` into a segment file and return its record (`name` is kept for error messages; the
        I/O context names the object and its requests)."""
        data = tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
        crcs = tuple(zlib.crc32(data[i : i + PAGE_BYTES]) for i in range(0, len(data), PAGE_BYTES))
        segment, offset = self._allocate(len(data))
        try:
            self._write_at(segment, offset, data, name)
        except OSError as exc:  # a full disk or a vanished directory: say which, never a bare traceback
            self.free_extents.setdefault(self._extent_bytes(len(data)), []).append((segment, offset))
            where = f"spill directory {self.root.parent}"
            raise EngineError(f"{where}: cannot write {name} ({len(data)} B: {exc.strerror or exc})") from None
        self.num_live_bytes += len(data)
        self.num_written_bytes += len(data)
        return SpillRecord(self.paths[segment], offset, tensor.dtype, tuple(tensor.shape), crcs)

    def _write_at(self, segment: int, offset: int, data: bytes, name: str) -> None:
        if self.io is None:
            written = os.pwrite(self.fds[segment], data, offset)
            if written != len(data):
                raise OSError(28, f"short write ({written} of {len(data)} B)")
            return
        padded = aligned_buffer(len(data))  # the whole extent, zero-padded: an O_DIRECT write
        padded[: len(data)] = data
        ctx = current_io_context()
        priority = IOPriority.KV_WRITE if ctx.priority is None else ctx.priority
        submit = functools.partial(
            self.io.submit_write, self.paths[segment], offset, memoryview(padded), ObjectKind.KV_BLOCK,
            ctx.object_id or name, ctx.requester_ids, priority=priority,
        )  # fmt: skip
        if self.is_writing_behind:
            self.behind.add((self.paths[segment], offset), name, len(data), submit, padded)
            return
        ticket = submit()
        try:
            self.io.wait(ticket)
        except IOSchedulerError as exc:
            raise OSError(errno.EIO, ticket.record.error or str(exc)) from None
        ctx.note_end(ticket.record.end_ns)

    def read(self, record: SpillRecord) -> torch.Tensor:
        """Read a tensor back; raises ChecksumError if any page does not match its CRC."""
        return self.finish_read(self.submit_read(record))

    def submit_read(self, record: SpillRecord) -> PendingRead:
        """Queue a record's read on the I/O scheduler (read at :meth:`finish_read` without one), so several
        records' reads can be in flight at once."""
        self._settle(record)
        raw = torch.empty(record.num_bytes, dtype=torch.uint8)
        if self.io is None:
            return PendingRead(record, raw, None, current_io_context())
        ctx = current_io_context()
        name = ctx.object_id or f"{record.path.name}@{record.offset}"
        priority = IOPriority.KV_READ if ctx.priority is None else ctx.priority
        ticket = self.io.submit_read(
            record.path, record.offset, record.num_bytes, ObjectKind.KV_BLOCK, name, ctx.requester_ids,
            into=memoryview(raw.numpy()), priority=priority,
        )  # fmt: skip
        return PendingRead(record, raw, ticket, ctx)

    def finish_read(self, pending: PendingRead) -> torch.Tensor:
        """A submitted read's tensor once its bytes are in (checksums verified)."""
        record = pending.record
        if pending.ticket is None:
            self.read_into(record, pending.raw)
        else:
            try:
                assert self.io is not None
                self.io.wait(pending.ticket)
            except IOSchedulerError as exc:
                raise ChecksumError(f"{record.path.name}@{record.offset}: {exc}") from None
            pending.ctx.note_end(pending.ticket.record.end_ns)
            self.num_read_bytes += pending.ticket.record.num_bytes_done
            self._verify(record, memoryview(pending.raw.numpy()))
        return pending.raw.view(record.dtype).reshape(record.shape)

    def read_into(self, record: SpillRecord, out: torch.Tensor) -> None:
        """Read a record's bytes into the contiguous CPU uint8 tensor `out` in this thread (checksums
        verified)."""
        self._settle(record)
        view = memoryview(out.numpy())
        got = os.preadv(self.fds[self.paths.index(record.path)], [view], record.offset)
        self.num_read_bytes += got
        if got != record.num_bytes:
            raise ChecksumError(f"{record.path.name}@{record.offset}: {got} of {record.num_bytes} B read")
        self._verify(record, view)

    def _settle(self, record: SpillRecord) -> None:
        """Wait for the record's write if it is held back or in flight (a failed one: :class:`EngineError`)."""
        try:
            self.behind.settle(self.io, (record.path, record.offset))
        except WriteFailed as exc:
            raise EngineError(f"spill directory {self.root.parent}: cannot write {exc}") from None

    def _verify(self, record: SpillRecord, view: memoryview) -> None:
        if self.is_checksum_verified:
            for page, expected in enumerate(record.page_crcs):
                if zlib.crc32(view[page * PAGE_BYTES : (page + 1) * PAGE_BYTES]) != expected:
                    raise ChecksumError(f"{record.path.name}@{record.offset}: page {page} checksum mismatch")

    def delete(self, record: SpillRecord) -> None:
        """Free a record's extent for reuse (a record of a closed or foreign directory is ignored)."""
        if record.path not in self.paths:
            return
        self._settle(record)  # the extent is reused only once written
        segment = self.paths.index(record.path)
        self.free_extents.setdefault(self._extent_bytes(record.num_bytes), []).append((segment, record.offset))
        self.num_live_bytes -= record.num_bytes

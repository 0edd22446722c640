"""Page-cache-free file I/O: aligned buffers and file descriptors opened with ``O_DIRECT``.

``O_DIRECT`` needs the buffer address, the offset and the length aligned to the device's logical block;
:data:`ALIGN` (4 KiB) covers every common device. Anonymous ``mmap`` memory is page aligned, so
:func:`aligned_buffer` is one. A file system that refuses ``O_DIRECT`` (tmpfs) gets buffered descriptors
whose pages :func:`drop_cached` evicts with ``posix_fadvise(DONTNEED)``; :func:`open_direct` says which
one it returned.
"""

from __future__ import annotations

import errno
import mmap
import os

ALIGN = 4096  # bytes: the alignment O_DIRECT offsets, lengths and buffers keep
O_DIRECT = getattr(os, "O_DIRECT", 0)


def aligned_buffer(num_bytes: int) -> mmap.mmap:
    """A zeroed, page-aligned buffer of at least `num_bytes` (rounded up to :data:`ALIGN`)."""
    if num_bytes <= 0:
        raise ValueError(f"buffer size must be > 0, got {num_bytes}")
    return mmap.mmap(-1, round_up(num_bytes))


def round_up(num_bytes: int, align: int = ALIGN) -> int:
    """`num_bytes` rounded up to a multiple of `align`."""
    return -(-num_bytes // align) * align


def is_aligned(offset: int, num_bytes: int) -> bool:
    """Whether a transfer at `offset` of `num_bytes` may use ``O_DIRECT``."""
    return offset % ALIGN == 0 and num_bytes % ALIGN == 0


def open_direct(path: str | os.PathLike[str], is_write: bool = False, create: bool = False) -> tuple[int, bool]:
    """(descriptor, whether it bypasses the page cache) for `path`: ``O_DIRECT`` where the file system
    allows it, else a buffered descriptor."""
    flags = (os.O_RDWR if is_write else os.O_RDONLY) | (os.O_CREAT if create else 0)
    if O_DIRECT:
        try:
            return os.open(path, flags | O_DIRECT, 0o600), True
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
    return os.open(path, flags, 0o600), False


def drop_cached(fd: int) -> None:
    """Ask the kernel to drop the file's cached pages (written pages are flushed first)."""
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def make_scratch_file(path: str | os.PathLike[str], num_bytes: int, chunk_bytes: int = 4 << 20) -> None:
    """Write `num_bytes` (rounded up to :data:`ALIGN`) of random data to `path`, fsync it and drop its pages:
    reads of it then come from the device."""
    num_bytes = round_up(num_bytes)
    chunk = os.urandom(min(chunk_bytes, num_bytes))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        written = 0
        while written < num_bytes:
            written += os.write(fd, chunk[: num_bytes - written])
        drop_cached(fd)
    finally:
        os.close(fd)

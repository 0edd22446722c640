"""One worker's side of a transfer: read into or write from a buffer, around the page cache where it can."""

from __future__ import annotations

import os

import numpy as np

from fallbackgate.engine.io.direct import ALIGN, aligned_buffer, round_up
from fallbackgate.engine.io.requests import IORecord

Buffer = bytearray | memoryview  # what reads fill and writes take (anything exposing a byte buffer)


class ShortReadError(OSError):
    """The file ended before the bytes asked for."""


class Bounce:
    """One worker's aligned staging buffer, grown on demand."""

    def __init__(self) -> None:
        self.buffer: memoryview | None = None

    def get(self, num_bytes: int) -> memoryview:
        """An aligned view of at least `num_bytes` (reused between transfers)."""
        if self.buffer is None or self.buffer.nbytes < num_bytes:
            self.buffer = memoryview(aligned_buffer(num_bytes))
        return self.buffer[:num_bytes]


def read_into(fd: int, is_direct: bool, record: IORecord, buffer: Buffer | None, bounce: Bounce) -> memoryview:
    """Read `record`'s range through `fd` into `buffer` (a new one when None); returns exactly its bytes.
    On an ``O_DIRECT`` descriptor an unaligned range, or an unaligned buffer, goes through `bounce`."""
    r = record
    out = memoryview(buffer).cast("B")[: r.num_bytes] if buffer is not None else None
    if not is_direct:
        out = out if out is not None else memoryview(bytearray(r.num_bytes))
        r.num_bytes_done = _read_fully(fd, out, r.offset)
    else:
        low = r.offset // ALIGN * ALIGN
        span = round_up(r.offset + r.num_bytes) - low
        if out is not None and low == r.offset and span == r.num_bytes and address(out) % ALIGN == 0:
            r.num_bytes_done = _read_fully(fd, out, r.offset)
        else:
            staging = bounce.get(span)
            got = _read_fully(fd, staging, low, at_least=r.offset - low + r.num_bytes)
            r.num_bytes_done = max(0, min(r.num_bytes, got - (r.offset - low)))
            out = out if out is not None else memoryview(bytearray(r.num_bytes))
            out[: r.num_bytes_done] = staging[r.offset - low : r.offset - low + r.num_bytes_done]
    r.is_direct = is_direct
    if r.num_bytes_done < r.num_bytes:
        raise ShortReadError(f"short read: {r.num_bytes_done} of {r.num_bytes} bytes (end of file)")
    return out


def write_from(fd: int, is_direct: bool, record: IORecord, data: memoryview, bounce: Bounce) -> None:
    """Write `data` at `record`'s offset through `fd` (an unaligned buffer on ``O_DIRECT`` via `bounce`)."""
    r = record
    if is_direct and address(data) % ALIGN != 0:
        staging = bounce.get(r.num_bytes)
        staging[:] = data
        data = staging
    done = 0
    while done < r.num_bytes:
        done += os.pwritev(fd, [data[done:]], r.offset + done)
    r.num_bytes_done, r.is_direct = done, is_direct


def address(buffer: memoryview) -> int:
    """The buffer's first byte's address (0 for an empty one)."""
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data) if buffer.nbytes else 0


def _read_fully(fd: int, out: memoryview, offset: int, at_least: int | None = None) -> int:
    """Read into `out` from `offset` until it is full, `at_least` bytes came, or the file ends."""
    need = out.nbytes if at_least is None else at_least
    done = 0
    while done < need:
        got = os.preadv(fd, [out[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done

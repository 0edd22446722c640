"""The I/O scheduler on real files: bytes, page-cache bypass (counted by the kernel), order, queue state,
writes, and faults that stay with the transfer they hit."""

from __future__ import annotations

import os
import pathlib

import pytest

from fallbackgate.engine.io import IOOp, IOScheduler, IOSchedulerError
from fallbackgate.engine.io.direct import aligned_buffer, make_scratch_file
from fallbackgate.engine.tags import ObjectKind

MIB = 1 << 20


def _storage_read_bytes() -> int:
    """Bytes this process fetched from storage (the kernel's count; page-cache hits are not in it)."""
    for line in pathlib.Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise AssertionError("no read_bytes in /proc/self/io")


@pytest.fixture
def scratch(tmp_path: pathlib.Path) -> tuple[pathlib.Path, bytes]:
    path = tmp_path / "data.bin"
    make_scratch_file(path, 4 * MIB)
    return path, path.read_bytes()


@pytest.mark.parametrize(("offset", "num_bytes"), [(0, 65536), (4096 * 7, MIB), (12345, 70001), (4 * MIB - 3, 3)])
def test_reads_return_the_files_bytes(scratch: tuple[pathlib.Path, bytes], offset: int, num_bytes: int) -> None:
    path, content = scratch
    with IOScheduler(num_workers=2) as io:
        into = bytearray(num_bytes)
        given = io.wait(io.submit_read(path, offset, num_bytes, ObjectKind.EXPERT, "0:1", into=into))
        fresh = io.wait(io.submit_read(path, offset, num_bytes, ObjectKind.KV_BLOCK, "r:0:0"))
        aligned = memoryview(aligned_buffer(num_bytes))
        direct = io.wait(io.submit_read(path, offset, num_bytes, ObjectKind.EXPERT, "0:2", into=aligned))
    expected = content[offset : offset + num_bytes]
    assert bytes(given) == bytes(into) == bytes(fresh) == bytes(direct) == expected


def test_direct_reads_come_from_storage_not_the_page_cache(scratch: tuple[pathlib.Path, bytes]) -> None:
    path, content = scratch
    path.read_bytes()  # every page now cached
    with IOScheduler(num_workers=1) as io:
        before = _storage_read_bytes()
        for _ in range(3):
            ticket = io.submit_read(path, 8192, MIB, ObjectKind.EXPERT, "0:0")
            assert bytes(io.wait(ticket)) == content[8192 : 8192 + MIB]
            assert ticket.record.is_direct
        direct_bytes = _storage_read_bytes() - before
        before = _storage_read_bytes()
        io.wait(io.submit_read(path, 8192, MIB, ObjectKind.EXPERT, "0:0", direct=False))
        buffered_bytes = _storage_read_bytes() - before
    assert direct_bytes >= 3 * MIB  # read three times from the device though cached
    assert buffered_bytes < MIB // 4  # the buffered read was served from the page cache


def test_priority_order_queue_state_and_requesters(scratch: tuple[pathlib.Path, bytes]) -> None:
    path, _ = scratch
    io = IOScheduler(num_workers=1)
    with io._lock:  # workers cannot take anything until every transfer is queued
        tickets = [
            io.submit_read(path, 0, 65536, ObjectKind.EXPERT, "2:5", ["req-a"], priority=2),
            io.submit_read(path, 65536, 65536, ObjectKind.KV_BLOCK, "req-b:1:0", ["req-b"], priority=0),
            io.submit_read(path, 0, 4096, ObjectKind.EXPERT, "2:6", ["req-a", "req-b"], priority=1),
        ]
        snap = io.snapshot()
    assert [t.record.queue_depth_at_submit for t in tickets] == [0, 1, 2]
    assert [e.object_id for e in snap.queued] == ["req-b:1:0", "2:6", "2:5"] and snap.in_flight == ()
    assert snap.depth == 3 and snap.queued_bytes == 65536 * 2 + 4096
    assert snap.requester_bytes("req-a") == 65536 + 4096 and snap.requester_bytes("req-c") == 0
    for ticket in tickets:
        io.wait(ticket)
    io.close()
    starts = {t.record.object_id: t.record.start_ns for t in tickets}
    assert starts["req-b:1:0"] < starts["2:6"] < starts["2:5"]
    done = io.snapshot()
    assert done.depth == 0 and done.num_completed == 3 and done.num_bytes_read == 65536 * 2 + 4096
    for record in (t.record for t in tickets):
        assert record.submit_ns <= record.start_ns <= record.end_ns and record.service_s > 0


def test_writes_aligned_and_not_land_in_the_file(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "spill.bin"
    aligned = os.urandom(2 * 65536)
    odd = os.urandom(1000)
    with IOScheduler(num_workers=2) as io:
        first = io.submit_write(path, 0, aligned, ObjectKind.KV_BLOCK, "r:0:0", ["r"])
        io.wait(first)
        second = io.submit_write(path, 131072 + 17, odd, ObjectKind.KV_BLOCK, "r:0:1", ["r"])
        assert io.wait(second) is None
        back = io.wait(io.submit_read(path, 0, 131072 + 17 + 1000, ObjectKind.KV_BLOCK, "r:0:*"))
        assert io.snapshot().num_bytes_written == 2 * 65536 + 1000
    assert first.record.is_direct and not second.record.is_direct  # an unaligned write is buffered
    assert bytes(back[:131072]) == aligned and bytes(back[131072 + 17 :]) == odd
    records = [first.record, second.record]
    assert [r.op for r in records] == [IOOp.WRITE, IOOp.WRITE] and records[1].num_bytes_done == 1000


def test_a_failed_transfer_fails_alone(scratch: tuple[pathlib.Path, bytes], tmp_path: pathlib.Path) -> None:
    path, content = scratch
    with IOScheduler(num_workers=2) as io:
        past_end = io.submit_read(path, 4 * MIB - 100, 200, ObjectKind.EXPERT, "9:9", ["victim"])
        missing = io.submit_read(tmp_path / "absent.bin", 0, 4096, ObjectKind.EXPERT, "9:8", ["victim"])
        fine = io.submit_read(path, 0, 4096, ObjectKind.EXPERT, "0:0", ["bystander"])
        short = r"read of 200 bytes at 4194204 of .*data.bin: ShortReadError: short read: 100 of 200"
        with pytest.raises(IOSchedulerError, match=short):
            io.wait(past_end)
        with pytest.raises(IOSchedulerError, match="absent.bin"):
            io.wait(missing)
        assert bytes(io.wait(fine)) == content[:4096]
        read_only = io.submit_read(path, 0, 4096, ObjectKind.EXPERT, "9:7", into=memoryview(bytes(4096)))
        with pytest.raises(IOSchedulerError, match="TypeError"):  # a bad buffer fails its read, not the worker
            io.wait(read_only)
        assert bytes(io.wait(io.submit_read(path, 4096, 4096, ObjectKind.EXPERT, "0:1"))) == content[4096:8192]
        completed = io.take_completed()
        assert {r.object_id for r in completed} == {"9:9", "9:8", "9:7", "0:0", "0:1"} and io.take_completed() == []
        assert sum(1 for r in completed if r.error) == 3
        with pytest.raises(ValueError, match="into a buffer of 10"):
            io.submit_read(path, 0, 4096, ObjectKind.EXPERT, "0:0", into=bytearray(10))
        with pytest.raises(ValueError, match="must be positive"):
            io.submit_read(path, -1, 4096, ObjectKind.EXPERT, "0:0")
    with pytest.raises(IOSchedulerError, match="after the I/O scheduler closed"):
        io.submit_read(path, 0, 4096, ObjectKind.EXPERT, "0:0")


def test_cancel_and_close_leave_no_ticket_waiting(scratch: tuple[pathlib.Path, bytes]) -> None:
    path, content = scratch
    io = IOScheduler(num_workers=1)
    with io._lock:  # nothing starts before the cancel
        kept = io.submit_read(path, 0, 4096, ObjectKind.EXPERT, "0:0")
        dropped = io.submit_read(path, 4096, 4096, ObjectKind.EXPERT, "0:1")
        assert io.cancel(dropped) and not io.cancel(dropped)
    assert bytes(io.wait(kept)) == content[:4096] and not io.cancel(kept)
    with pytest.raises(IOSchedulerError, match="cancelled"):
        io.wait(dropped)
    many = [io.submit_read(path, i * 65536, 65536, ObjectKind.EXPERT, f"1:{i}") for i in range(32)]
    io.close()  # finishes what is in flight, fails what is queued
    assert all(t.done.is_set() for t in many)
    for i, ticket in enumerate(many):
        if ticket.record.error:
            assert ticket.record.error == "I/O scheduler closed before it ran" and ticket.record.start_ns == 0
        else:
            assert bytes(ticket.data) == content[i * 65536 : (i + 1) * 65536]

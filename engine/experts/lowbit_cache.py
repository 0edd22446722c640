"""Low-bit expert copies persisted on disk, so a low-bit miss reads a half (int8) or a quarter (int4) of an
expert's bytes instead of the full expert.

One directory per checkpoint and bit width, keyed by the xxh3-64 of the checkpoint's manifest (a changed
checkpoint never meets an old copy): ``<root>/<manifest hash>/int<bits>/`` holds ``slots.bin``, one
4 KiB-aligned slot per expert (gate_up's codes, scales, zero points, then down's), and ``index.json``, per
expert its slot and the xxh3-64 of the slot's bytes. Reads use O_DIRECT (no page cache: the bytes a tag
reports are bytes the disk delivered), go through the engine's I/O scheduler when one is attached (`io`: the
disk's one queue, at the priority and for the requests of the caller's :func:`io_context`), and are checked
against the index; a mismatch drops the entry (the copy is made again from the checkpoint). The slots stop at
`cap_bytes`.
"""

from __future__ import annotations

import json
import mmap
import os
import pathlib
from collections.abc import Callable, Iterable

import torch
import tqdm
import xxhash

from fallbackgate.engine.errors import ExpertReadError
from fallbackgate.engine.experts.quant import Quantized, quantize
from fallbackgate.engine.experts.weights import ExpertWeights
from fallbackgate.engine.io import IOPriority, IOScheduler, IOSchedulerError, Ticket, current_io_context
from fallbackgate.engine.model.checkpoint_files import DIRECT_ALIGN
from fallbackgate.engine.tags import ObjectKind

INDEX_VERSION = 1
LowbitPair = tuple[Quantized, Quantized]  # gate_up, down


def manifest_hash(manifest_file: pathlib.Path) -> str:
    """xxh3-64 (hex) of the checkpoint's manifest file: the cache's key."""
    return xxhash.xxh3_64(manifest_file.read_bytes()).hexdigest()


def _parts(pair: LowbitPair) -> list[torch.Tensor]:
    return [t.contiguous() for q in pair for t in (q.codes, q.scales, q.zeros)]


class LowbitDiskCache:
    """Fixed-size slots of one bit width's low-bit copies of one checkpoint's experts."""

    def __init__(
        self,
        root: pathlib.Path,
        key_hash: str,
        bits: int,
        matrix_shapes: tuple[tuple[int, int], tuple[int, int]],
        cap_bytes: int,
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        # copies are made from the compute dtype's weights: another dtype's copies may differ in a code
        self.dir = root / key_hash / f"int{bits}-{str(compute_dtype).removeprefix('torch.')}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.bits = bits
        self.template = tuple(quantize(torch.zeros(shape), bits, axis=1) for shape in matrix_shapes)
        self.copy_bytes = sum(t.numel() * t.element_size() for t in _parts(self.template))  # as a tag counts it
        self.slot_bytes = -(-self.copy_bytes // DIRECT_ALIGN) * DIRECT_ALIGN
        self.num_slots = max(0, cap_bytes) // self.slot_bytes
        self.index_file, self.slots_file = self.dir / "index.json", self.dir / "slots.bin"
        self.slots: dict[str, tuple[int, str]] = self._load_index()  # "layer:expert" -> (slot, xxh3-64)
        self.num_bytes_read = 0
        self.io: IOScheduler | None = None  # the engine's disk queue reads go through (None: read inline)
        self.flights: dict[str, Ticket] = {}  # reads queued ahead of their use (`start_read`), by name
        self.buffer = mmap.mmap(-1, self.slot_bytes)  # page-aligned, for O_DIRECT
        try:
            self.fd = os.open(self.slots_file, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o644)
        except OSError:  # a file system without O_DIRECT: buffered (the page cache may then serve reads)
            self.fd = os.open(self.slots_file, os.O_RDWR | os.O_CREAT, 0o644)

    def _load_index(self) -> dict[str, tuple[int, str]]:
        try:
            body = json.loads(self.index_file.read_text())
            if body.get("version") != INDEX_VERSION or body.get("slot_bytes") != self.slot_bytes:
                return {}
            return {k: (int(s), str(d)) for k, (s, d) in body["slots"].items() if int(s) < self.num_slots}
        except (OSError, ValueError, KeyError, TypeError):
            return {}  # absent or unreadable: start empty (copies are remade from the checkpoint)

    def _save_index(self) -> None:
        body = {"version": INDEX_VERSION, "slot_bytes": self.slot_bytes, "slots": self.slots}
        tmp = self.index_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(body))
        tmp.replace(self.index_file)

    def __contains__(self, key: tuple[int, int]) -> bool:
        """Whether expert `key` has a persisted copy (not yet verified: a corrupt one is found by `get`)."""
        return f"{key[0]}:{key[1]}" in self.slots

    def get(self, key: tuple[int, int]) -> LowbitPair | None:
        """The persisted copy of expert `key`, read from disk and verified; None when absent, corrupt (the entry
        is dropped) or not read (the I/O scheduler refused or failed the read: the entry is kept)."""
        name = f"{key[0]}:{key[1]}"
        if name not in self.slots:
            return None
        slot, digest = self.slots[name]
        if self.io is None:
            got, read = os.preadv(self.fd, [self.buffer], slot * self.slot_bytes), memoryview(self.buffer)
        else:
            got, read = self._queued(name, slot)
        if got < 0:
            return None
        self.num_bytes_read += got
        raw = read[: self.copy_bytes]
        if got < self.copy_bytes or xxhash.xxh3_64(raw).hexdigest() != digest:
            del self.slots[name]
            self._save_index()
            return None
        data, offset, tensors = torch.frombuffer(bytearray(raw), dtype=torch.uint8), 0, []  # the one copy kept
        for template in _parts(self.template):
            size = template.numel() * template.element_size()
            tensors.append(data[offset : offset + size].view(template.dtype).view(template.shape))
            offset += size
        return tuple(  # type: ignore[return-value]
            Quantized(tensors[3 * i], tensors[3 * i + 1], tensors[3 * i + 2], q.bits, q.axis, q.group_size, q.shape)
            for i, q in enumerate(self.template)
        )

    def start_read(self, key: tuple[int, int]) -> bool:
        """Queue the read of expert `key`'s persisted copy ahead of its use, through the I/O scheduler at the
        priority and for the requests of the caller's :func:`io_context`; :meth:`get` then waits for it.
        False when there is no scheduler, no persisted copy, a read already queued, or the scheduler refused.
        The read lands in a buffer of `slot_bytes` the scheduler allocates (the caller counts it)."""
        name = f"{key[0]}:{key[1]}"
        if self.io is None or name not in self.slots or name in self.flights:
            return False
        try:
            self.flights[name] = self._submit(name, self.slots[name][0])
        except IOSchedulerError:
            return False
        return True

    def drop_reads(self) -> int:
        """Settle every read queued ahead and not taken by :meth:`get` (taken off the queue, or waited for when
        already running); returns how many there were."""
        flights, self.flights = self.flights, {}
        for ticket in flights.values():
            if self.io is not None and not self.io.cancel(ticket):
                try:
                    self.io.wait(ticket)
                except IOSchedulerError:
                    pass  # an unused read that failed is simply dropped
        return len(flights)

    def _submit(self, name: str, slot: int) -> Ticket:
        """Submit the read of `slot` for the caller's :func:`io_context` (priority: an expert miss's unless
        it names one)."""
        assert self.io is not None
        ctx = current_io_context()
        priority = IOPriority.EXPERT_MISS if ctx.priority is None else ctx.priority
        return self.io.submit_read(  # into the scheduler's own aligned buffer: workers may hold a view of it
            self.slots_file, slot * self.slot_bytes, self.slot_bytes, ObjectKind.EXPERT, ctx.object_id or name,
            ctx.requester_ids, priority=priority,
        )  # fmt: skip

    def _queued(self, name: str, slot: int) -> tuple[int, memoryview]:
        """Read `slot` through the I/O scheduler (or take the read queued ahead for it): the bytes read and a
        view of them (-1 when the scheduler refused or failed the read: a transfer's fault, not the copy's)."""
        assert self.io is not None
        try:
            ticket = self.flights.pop(name, None) or self._submit(name, slot)
            data = self.io.wait(ticket)
        except IOSchedulerError:
            return -1, memoryview(b"")
        assert data is not None, "a read returns its bytes"
        current_io_context().note_end(ticket.record.end_ns)
        return ticket.record.num_bytes_done, memoryview(data).cast("B")

    def put(self, key: tuple[int, int], pair: LowbitPair, is_saved: bool = True) -> bool:
        """Persist expert `key`'s copy in the next free slot; False when the cap is reached. `is_saved`
        False leaves the index file to the caller (:meth:`fill` writes it once)."""
        name = f"{key[0]}:{key[1]}"
        used = {slot for slot, _ in self.slots.values()}
        free = next((s for s in range(self.num_slots) if s not in used), None)
        if free is None:
            return False
        raw = b"".join(t.view(torch.uint8).reshape(-1).numpy().tobytes() for t in _parts(pair))
        if len(raw) != self.copy_bytes:
            raise ValueError(f"low-bit copy of expert {key} has {len(raw)} B, slots hold {self.copy_bytes} B")
        view = memoryview(self.buffer)
        view[: len(raw)] = raw
        view[len(raw) :] = bytes(self.slot_bytes - len(raw))
        os.pwritev(self.fd, [self.buffer], free * self.slot_bytes)
        self.slots[name] = (free, xxhash.xxh3_64(raw).hexdigest())
        if is_saved:
            self._save_index()
        return True

    def fill(
        self,
        keys: Iterable[tuple[int, int]],
        read: Callable[[tuple[int, int]], ExpertWeights],
        progress: bool = False,
    ) -> int:
        """Persist a copy of every expert in `keys` that has none, made from ``read(key)`` (its full-precision
        weights in the compute dtype, quantized as a low-bit miss quantizes them), until the cap; returns the
        copies made. An expert that cannot be read (``read`` raises :class:`ExpertReadError`) is skipped: its
        copy is made, or its fault found, on first use."""
        missing = [key for key in keys if key not in self]
        num_made, shown = 0, progress and bool(missing)
        try:
            for key in tqdm.tqdm(missing, desc=f"int{self.bits} expert copies", unit="expert", disable=not shown):
                if len(self.slots) >= self.num_slots:
                    break  # the cap: the rest are made on first use
                try:
                    full = read(key)
                except ExpertReadError:
                    continue
                pair = (quantize(full.gate_up, self.bits, axis=1), quantize(full.down, self.bits, axis=1))
                num_made += self.put(key, pair, is_saved=False)
        finally:
            if num_made:
                self._save_index()
        return num_made

    def close(self) -> None:
        """Settle reads queued ahead; close the slots file and the read buffer."""
        self.drop_reads()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if not self.buffer.closed:
            self.buffer.close()

"""Low-bit (int8/int4) copies of experts: made on first use, kept while their pool has room, persisted on a CPU.

On CUDA they are counted in the host pool (full host copies make room for them: those can be re-read); on a
CPU (``ram_disk``) in the RAM pool, least recently used first to go when the pool needs room (`drop`).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from fallbackgate.engine.device_pool import PoolKind, TierPool
from fallbackgate.engine.experts.lowbit_cache import LowbitDiskCache
from fallbackgate.engine.experts.quant import (
    Quantized,
    dequant_chunk_rows,
    dequantize_rows,
    lowbit_expert_nbytes,
    quantize,
    quantized_to,
)
from fallbackgate.engine.experts.reader import ExpertReader
from fallbackgate.engine.experts.sources import ExpertKey
from fallbackgate.engine.experts.weights import ExpertWeights, Fetched
from fallbackgate.engine.tags import Tier

DEQUANT_NUMEL = (1 << 14, 1 << 18)  # fewest and most elements dequantized at a time (64 KiB, 1 MiB in fp32)

LowbitPair = tuple[Quantized, Quantized]  # (gate_up, down)


class HoldsCopies(Protocol):
    """What the low-bit copies read of a store entry."""

    device: ExpertWeights | None
    lowbit: LowbitPair | None


class LowbitCopies:
    """The store's low-bit copies: each lives in its entry's ``lowbit``; this part makes, keeps and drops them."""

    def __init__(
        self,
        bits: int,
        reader: ExpertReader,
        device: torch.device,
        entries: Mapping[ExpertKey, HoldsCopies],
        pool: TierPool,
        kind: PoolKind,
        is_ram_tiered: bool,
        is_in_place: bool,
    ) -> None:
        self.bits, self.reader, self.device, self.entries = bits, reader, device, entries
        self.pool, self.kind = pool, kind  # where low-bit copies are counted, and as what
        self.is_ram_tiered, self.is_in_place = is_ram_tiered, is_in_place
        self.lru: collections.OrderedDict[ExpertKey, None] = collections.OrderedDict()  # CPU: kept copies
        self.cache: LowbitDiskCache | None = None  # CPU: persisted low-bit copies (set by build_stores)

    def weights(
        self, key: ExpertKey, read_full: Callable[[ExpertKey], Fetched], free_host: Callable[[int], None]
    ) -> Fetched:
        """Dequantized low-bit copy (made now from `read_full` if it does not exist); bytes moved are the
        low-bit bytes (on a CPU only what was read from disk: a copy kept in RAM, or made from a resident
        one, moves nothing). `free_host(n)` makes room for n bytes in the host cache (CUDA)."""
        entry, source, moved, note = self.entries[key], Tier.HOST, 0, ""
        if entry.lowbit is None:
            full = entry.device if self.is_in_place and entry.device is not None else None
            low, slot_read = None, 0
            if full is None and self.cache is not None:
                before = self.cache.num_bytes_read
                low = self.cache.get(key)
                slot_read = self.cache.num_bytes_read - before
            if low is not None:  # persisted: a half or a quarter of the expert's bytes read from disk
                source, moved, note = Tier.DISK, low[0].num_bytes + low[1].num_bytes, "persisted low-bit copy"
            else:
                if slot_read:  # a persisted copy failed its check: its slot was read, then dropped
                    source, moved, note = Tier.DISK, slot_read, "persisted low-bit copy corrupt, remade"
                if full is None:
                    fetched = read_full(key)
                    full, note = fetched.weights, note or fetched.note
                    if fetched.source_tier is Tier.DISK:
                        source, moved = Tier.DISK, moved + fetched.bytes_moved
                low = (quantize(full.gate_up, self.bits, axis=1), quantize(full.down, self.bits, axis=1))
                if self.cache is not None:
                    self.cache.put(key, low)
            self._keep(key, low, free_host)
        else:
            low = entry.lowbit
            if key in self.lru:
                self.lru.move_to_end(key)
        dtype = self.reader.compute_dtype
        # the low-bit bytes cross the link; dequantized where the expert runs
        weights = ExpertWeights(dequantized(low[0], self.device, dtype), dequantized(low[1], self.device, dtype))
        if self.is_ram_tiered:  # no link after the disk: the copy is computed with where it is, in RAM
            return Fetched(weights, Tier.DISK if moved else None, moved, note)
        return Fetched(weights, source, moved + low[0].num_bytes + low[1].num_bytes, note)

    def disk_read_bytes(self, key: ExpertKey, home: Tier, num_full_bytes: int) -> int:
        """Bytes :meth:`weights` must read from disk before `key` can run low-bit: none for a kept copy or
        one made from a resident or host copy, a low-bit copy's for a persisted one, the whole expert
        (`num_full_bytes`) for one made from the checkpoint on disk (`home`)."""
        if self._is_at_hand(key):
            return 0
        if self.cache is not None and key in self.cache:
            return self.cache.copy_bytes
        return num_full_bytes if home is Tier.DISK else 0

    def _is_at_hand(self, key: ExpertKey) -> bool:
        """Whether `key` runs low-bit without a disk read: a kept copy, or a resident full copy to quantize."""
        entry = self.entries[key]
        return entry.lowbit is not None or (self.is_in_place and entry.device is not None)

    def is_read_from_cache(self, key: ExpertKey) -> bool:
        """Whether `key`'s next low-bit run reads its persisted copy (no kept copy, no resident full copy)."""
        return self.cache is not None and not self._is_at_hand(key) and key in self.cache

    def start_read(self, key: ExpertKey) -> bool:
        """Queue the read of `key`'s persisted copy ahead of its use (:meth:`weights` then takes it); whether it
        was queued. It holds a buffer of `read_buffer_bytes` until taken or settled by :meth:`drop_reads`."""
        return self.is_read_from_cache(key) and self.cache is not None and self.cache.start_read(key)

    @property
    def read_buffer_bytes(self) -> int:
        """Bytes of one read queued ahead (a persisted copy's 4 KiB-aligned slot); 0 without persisted copies."""
        return self.cache.slot_bytes if self.cache is not None else 0

    def drop_reads(self) -> int:
        """Settle the reads queued ahead that no use took; how many there were."""
        return self.cache.drop_reads() if self.cache is not None else 0

    def _keep(self, key: ExpertKey, low: LowbitPair, free_host: Callable[[int], None]) -> None:
        """Keep a new low-bit copy while its pool has room: on CUDA full host copies make room (they can be
        re-read); on a CPU the RAM pool must have it free (nothing else is evicted for it)."""
        low_bytes = low[0].num_bytes + low[1].num_bytes
        if not self.is_ram_tiered:
            free_host(low_bytes)
        if self.pool.can_reserve(low_bytes):
            self.pool.reserve(self.kind, low_bytes)
            self.entries[key].lowbit = low
            if self.is_ram_tiered:
                self.lru[key] = None

    def drop(self, is_done: Callable[[], bool]) -> int:
        """Drop kept copies, least recently used first, until `is_done()` or none is left; returns the number
        dropped (a copy is remade from the checkpoint on its next use)."""
        num_dropped = 0
        while self.lru and not is_done():
            key, _ = self.lru.popitem(last=False)
            low, self.entries[key].lowbit = self.entries[key].lowbit, None
            assert low is not None
            self.pool.release(self.kind, low[0].num_bytes + low[1].num_bytes)
            num_dropped += 1
        return num_dropped

    def scratch_bytes(self, bytes_per_expert: int) -> int:
        """Device bytes an expert_lowbit computation holds at its peak: the low-bit copy as stored (codes,
        int4 packed two per byte, with fp32 scales and zero points), the weights in the compute dtype, and
        the working set of :func:`dequantized`: one fp32 chunk (`dequant_chunk_rows` of DEQUANT_NUMEL, at
        least one row), and for int4 that chunk's codes unpacked (its two nibble halves and the unpacked codes)."""
        bits = self.bits or 8
        chunk, unpacked = 0, 0
        for num_rows, num_cols in self.reader.matrix_shapes:
            num_chunk_rows = min(num_rows, dequant_chunk_rows((num_rows, num_cols), *DEQUANT_NUMEL))
            chunk = max(chunk, num_chunk_rows * num_cols)
            unpacked = max(unpacked, 2 * num_chunk_rows * (num_cols + 1))  # an odd row pads one code
        lowbit = lowbit_expert_nbytes(self.reader.matrix_shapes, bits)
        return lowbit + bytes_per_expert + 4 * chunk + (unpacked if bits == 4 else 0)


def dequantized(q: Quantized, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A low-bit matrix copy dequantized on `device` into `dtype`, a chunk of rows at a time (the
    store's expert_lowbit path and the baselines that reproduce it)."""
    return dequantize_rows(quantized_to(q, device), dtype, dequant_chunk_rows(q.shape, *DEQUANT_NUMEL))

"""Tiered expert store: the checkpoint's files are every expert's disk tier; host memory is a bounded
cache of full-precision copies; the device tier holds the experts a step computes with.

Tier layouts (`TierLayout`):

- CUDA: device, host and disk. Low-bit copies are made the first time a controller asks for one and kept
  while the host budget allows.
- CPU (``ram_disk``): RAM is the one fast tier, the device pool. A resident expert is in RAM; an
  ``exact_load`` reads it from the checkpoint (O_DIRECT: the page cache is no second, uncounted RAM tier);
  an evicted one is gone. Low-bit copies live in the same RAM budget, least recently used first to go when
  the pool needs room (`drop_lowbit`). There is no host tier and no ``cpu_execute``.
- Emulated (tests only, on a CPU): CUDA's layout as two RAM budgets: the device tier aliases host memory
  (placing an expert moves its host copy into the device budget, evicting it hands the bytes back to the
  host cache when that has room).

Mechanism only: callers decide what to place and what to evict. Device copies are `placement.py`; the host
cache and the disk reads are `host_cache.py`; low-bit copies are `lowbit_copies.py`.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import torch

from fallbackgate.engine.config import TierLayout, tier_layout
from fallbackgate.engine.device_pool import HeldCopy, PoolKind, TierPool
from fallbackgate.engine.errors import EngineError
from fallbackgate.engine.experts.host_cache import HostCache
from fallbackgate.engine.experts.journal import ChangeLog
from fallbackgate.engine.experts.lowbit_cache import LowbitDiskCache
from fallbackgate.engine.experts.lowbit_copies import LowbitCopies, dequantized
from fallbackgate.engine.experts.placement import DevicePlacement, ExpertEntry
from fallbackgate.engine.experts.quarantine import ExpertQuarantined
from fallbackgate.engine.experts.reader import ExpertReader
from fallbackgate.engine.experts.slots import SlotPool
from fallbackgate.engine.experts.sources import ExpertKey
from fallbackgate.engine.experts.weights import ExpertWeights, Fetched
from fallbackgate.engine.pinned_memory import PinnedHostCopies
from fallbackgate.engine.tags import ObjectKind, Tier

__all__ = ["ExpertKey", "ExpertStore", "ExpertWeights", "Fetched", "dequantized"]


def pins_host_copies(layout: TierLayout) -> bool:
    """Whether host expert copies are page-locked: where a device reads them over a link (CUDA)."""
    return layout is TierLayout.DEVICE_HOST_DISK


class ExpertStore(DevicePlacement):
    """Every routed expert of the model, read from the checkpoint; the modules keep no expert weights."""

    def __init__(
        self,
        reader: ExpertReader,
        device_pool: TierPool,
        host_pool: TierPool,
        device: torch.device,
        lowbit_bits: int = 8,
        num_io_threads: int = 0,
        layout: TierLayout | None = None,
    ) -> None:
        self.reader, self.device_pool, self.host_pool, self.device = reader, device_pool, host_pool, device
        self.lowbit_bits = lowbit_bits
        self.layout = layout or tier_layout(device, is_emulated_device_tier=False)
        self.is_ram_tiered = self.layout is TierLayout.RAM_DISK  # RAM the one fast tier, the disk the other
        if self.is_ram_tiered and host_pool.budget_bytes:
            raise EngineError("a CPU engine has no host tier: RAM is the device pool; the host pool's budget must be 0")
        self.is_aliased = self.layout is TierLayout.EMULATED_DEVICE_HOST_DISK  # test only: two RAM budgets
        self.is_in_place = self.is_aliased or self.is_ram_tiered  # a read lands where the expert computes
        self.staging_pool = device_pool if self.is_ram_tiered else host_pool  # holds the reads ahead in flight
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # exact loads, prefetches
        self.entries: dict[ExpertKey, ExpertEntry] = {key: ExpertEntry() for key in sorted(reader.sources)}
        lowbit_pool = device_pool if self.is_ram_tiered else host_pool  # where low-bit copies are counted
        lowbit_kind: PoolKind = HeldCopy.EXPERT_LOWBIT if self.is_ram_tiered else ObjectKind.EXPERT
        self.lowbit = LowbitCopies(
            lowbit_bits, reader, device, self.entries, lowbit_pool, lowbit_kind, self.is_ram_tiered, self.is_in_place
        )
        # every key whose device or host copy came or went, in order: what readers consume instead of a walk
        self.journal: ChangeLog[ExpertKey] = ChangeLog(4 * len(self.entries))
        self.bytes_per_expert = reader.compute_bytes_per_expert  # what a device copy holds (pools count it)
        self.dequant_scratch_bytes = reader.dequant_scratch_bytes  # FP8: staging while a slot is filled
        self.place_bytes = self.bytes_per_expert + self.dequant_scratch_bytes  # device room an exact_load needs
        # FP8: the host copy (codes and scales) is not the device copy's bytes, so nothing moves between them
        self.is_moved_on_place = self.is_in_place and not reader.is_block_scaled
        self.checkpoint_bytes_per_expert = reader.checkpoint_bytes_per_expert  # what a read takes from the files
        self.stacked_layers: set[int] = set()  # layers whose experts all sit in one resident stack (pinned)
        pinner = PinnedHostCopies() if pins_host_copies(self.layout) else None
        self.host_cache = HostCache(
            reader, self.entries, self.journal, host_pool, self.staging_pool, num_io_threads, self.is_ram_tiered, pinner
        )
        self.read_ahead = self.host_cache.read_ahead
        self.stacked_spans: dict[int, tuple[int, int]] = {}  # stacked layer -> its contiguous slot range
        self.pending_ready: set[ExpertKey] = set()  # CUDA: placed on the copy stream, not yet waited for
        self.slot_freed: dict[int, torch.cuda.Event] = {}  # CUDA: freed slot -> when its last readers are done
        num_experts = collections.Counter(layer for layer, _ in self.entries)
        capacity = min(len(self.entries), device_pool.budget_bytes // max(1, self.bytes_per_expert))
        # every device copy is a slot of one stack (see slots.py); a slot's bytes are reserved while it is held
        self.slots = SlotPool(capacity, reader.matrix_shapes, reader.compute_dtype, device, dict(num_experts))

    def warm_host(self) -> int:
        """Fill the host cache in key order while it has room (what a fresh process would read first)."""
        return self.host_cache.warm()

    def queue_reads(self, needed: list[ExpertKey], predicted: list[ExpertKey], step_id: int) -> None:
        """Read ahead: the current layer's `needed` misses first, then the `predicted` experts of the next
        layer (see `HostCache.queue_reads`)."""
        self.host_cache.queue_reads(needed, predicted, step_id)

    def close(self) -> None:
        """Stop the read threads and give back the host room of reads nobody took."""
        self.host_cache.close()
        if self.lowbit.cache is not None:
            self.lowbit.cache.close()

    @property
    def host_lru(self) -> collections.OrderedDict[ExpertKey, None]:
        """The host copies, least recently used first."""
        return self.host_cache.lru

    @property
    def num_disk_reads(self) -> int:
        """Expert reads from the checkpoint so far (on demand and ahead)."""
        return self.host_cache.num_disk_reads

    @property
    def num_read_slots(self) -> int:
        """Experts that may be read ahead at once (0: no reads ahead)."""
        return self.host_cache.num_read_slots

    @property
    def is_disk_tiered(self) -> bool:
        """Some expert's only copy is the checkpoint on disk (set by `warm_host`)."""
        return self.host_cache.is_disk_tiered

    def evict_chosen(self, keys: list[ExpertKey]) -> None:
        """Step end: drop the device copies the controller chose to evict (those still on device)."""
        for key in keys:
            if self.is_on_device(key):
                self.evict(key)

    def end_step(self, prefetch: list[ExpertKey], next_step_id: int) -> list[tuple[ExpertKey, Fetched]]:
        """Step end: start the prefetches the controller chose while they fit the device budget (on the copy
        stream), then settle the reads ahead nobody took (unused ones join the host cache; their first use
        credits them). Returns the prefetches started."""
        started = []
        for key in prefetch:
            if self.is_on_device(key) or not self.device_pool.can_reserve(self.place_bytes):
                continue
            try:
                started.append((key, self.place(key)))
            except ExpertQuarantined:  # a prefetch found the fault: the requests that need it are told at use
                continue
        self.host_cache.settle_reads(next_step_id)
        return started

    # --- queries -------------------------------------------------------------------------------
    def home(self, key: ExpertKey) -> Tier:
        """Where a full-precision copy comes from: the host cache, or the checkpoint on disk."""
        entry = self.entries[key]
        return Tier.HOST if entry.host is not None or (self.is_aliased and entry.device is not None) else Tier.DISK

    def is_on_device(self, key: ExpertKey) -> bool:
        return self.entries[key].device is not None

    def has_lowbit(self, key: ExpertKey) -> bool:
        """True when a low-bit copy exists or can be made (it is made on first use; see `lowbit_disk_bytes`)."""
        return self.lowbit_bits > 0

    def lowbit_disk_bytes(self, key: ExpertKey) -> int:
        """Bytes serving `key` low-bit must first read from disk: 0 when a copy is kept or is made from a
        resident or host copy, a low-bit copy's when persisted, the whole expert when made from the checkpoint
        (a "fallback" that reads more than the exact load it replaces)."""
        if not self.lowbit_bits:
            return 0
        return self.lowbit.disk_read_bytes(key, self.home(key), self.checkpoint_bytes_per_expert)

    def device_keys(self) -> list[ExpertKey]:
        return [key for key, entry in self.entries.items() if entry.device is not None]

    @property
    def lowbit_scratch_bytes(self) -> int:
        """Device bytes an expert_lowbit computation holds at its peak (see `LowbitCopies.scratch_bytes`);
        counted in the device pool as Scratch.EXPERT_DEQUANT while the expert runs."""
        return self.lowbit.scratch_bytes(self.bytes_per_expert)

    @property
    def lowbit_lru(self) -> collections.OrderedDict[ExpertKey, None]:
        """CPU: the low-bit copies kept in RAM, least recently used first."""
        return self.lowbit.lru

    @property
    def lowbit_cache(self) -> LowbitDiskCache | None:
        """CPU: the persisted low-bit copies (set by build_stores), or None."""
        return self.lowbit.cache

    @lowbit_cache.setter
    def lowbit_cache(self, cache: LowbitDiskCache | None) -> None:
        self.lowbit.cache = cache

    # --- host and low-bit copies ----------------------------------------------------------------
    def host_weights(self, key: ExpertKey) -> Fetched:
        """Full-precision weights in host memory for cpu_execute (read from the checkpoint when not cached)."""
        if self.is_ram_tiered:
            raise EngineError("cpu_execute is not offered where the device is the CPU: RAM is the only fast tier")
        entry = self.entries[key]
        if self.is_aliased and entry.device is not None:
            return Fetched(entry.device, None, 0)
        return self.host_cache.read_home(key, is_cached=True)

    def lowbit_weights(self, key: ExpertKey) -> Fetched:
        """Dequantized low-bit copy (made now if it does not exist); bytes moved are the low-bit bytes (on a
        CPU only what was read from disk: a copy kept in RAM, or made from a resident one, moves nothing)."""
        return self.lowbit.weights(key, lambda k: self.host_cache.read_home(k, is_cached=False), self.host_cache.free)

    def is_lowbit_read_from_disk(self, key: ExpertKey) -> bool:
        """CPU: whether `key`'s next low-bit run reads its persisted low-bit copy from disk."""
        return self.lowbit.is_read_from_cache(key)

    def start_lowbit_read(self, key: ExpertKey) -> bool:
        """CPU: queue the disk read of `key`'s persisted low-bit copy ahead of its use; whether it was queued
        (it holds `lowbit_read_bytes` until its use takes it or `drop_lowbit_reads`)."""
        return self.lowbit.start_read(key)

    @property
    def lowbit_read_bytes(self) -> int:
        """Bytes one low-bit read queued ahead holds until its copy is taken."""
        return self.lowbit.read_buffer_bytes

    def drop_lowbit_reads(self) -> int:
        """Settle the low-bit reads queued ahead that no use took; how many there were."""
        return self.lowbit.drop_reads()

    def drop_lowbit(self, num_bytes: int, is_done: Callable[[], bool] | None = None) -> int:
        """On a CPU: drop low-bit copies kept in RAM, least recently used first, until `is_done()` (default:
        `num_bytes` free in the RAM pool) or none is left; returns the number dropped (a copy is remade from
        the checkpoint on its next use)."""
        return self.lowbit.drop(is_done or (lambda: self.device_pool.can_reserve(num_bytes)))

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

Mechanism only: callers decide what to place and what to evict.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

import torch

from fallbackgate.engine.config import TierLayout, tier_layout
from fallbackgate.engine.device_pool import HeldCopy, PoolKind, TierPool
from fallbackgate.engine.errors import EngineError
from fallbackgate.engine.experts.journal import ChangeLog
from fallbackgate.engine.experts.lowbit_cache import LowbitDiskCache
from fallbackgate.engine.experts.quant import Quantized, dequantize_rows, lowbit_expert_nbytes, quantize, quantized_to
from fallbackgate.engine.experts.quarantine import ExpertQuarantined, read_checked
from fallbackgate.engine.experts.read_ahead import ReadAhead
from fallbackgate.engine.experts.reader import ExpertKey, ExpertReader
from fallbackgate.engine.experts.slots import SlotPool
from fallbackgate.engine.experts.weights import ExpertWeights
from fallbackgate.engine.tags import ObjectKind, Tier

__all__ = ["ExpertKey", "ExpertStore", "ExpertWeights", "Fetched"]

READ_SLOTS = 8  # experts read ahead at once at most

DEQUANT_ROWS = 64  # rows dequantized at a time: bounds the fp32 working set of an expert_lowbit copy


@dataclasses.dataclass(slots=True)
class Fetched:
    """Weights handed to a caller, with what it cost to get them."""

    weights: ExpertWeights  # ready to compute with
    source_tier: Tier | None  # where bytes came from (None: nothing moved)
    bytes_moved: int  # bytes read over a link (from the disk: the checkpoint's bytes, codes and scales as stored)
    note: str = ""  # e.g. a checksum failure that a re-read cleared


@dataclasses.dataclass(slots=True)
class _Entry:
    host: ExpertWeights | None = None  # full-precision copy in the host cache (host pool)
    device: ExpertWeights | None = None  # device copy (device pool); on CPU the former host tensors
    lowbit: tuple[Quantized, Quantized] | None = None  # int8/int4 copy in host memory, made on demand
    ready: torch.cuda.Event | None = None  # CUDA: set when an async (side-stream) copy completes


class ExpertStore:
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
        self.lowbit_pool = device_pool if self.is_ram_tiered else host_pool  # where low-bit copies are counted
        self.lowbit_kind: PoolKind = HeldCopy.EXPERT_LOWBIT if self.is_ram_tiered else ObjectKind.EXPERT
        self.staging_pool = device_pool if self.is_ram_tiered else host_pool  # holds the reads ahead in flight
        self.lowbit_lru: collections.OrderedDict[ExpertKey, None] = collections.OrderedDict()
        self.lowbit_cache: LowbitDiskCache | None = None  # CPU: persisted low-bit copies (set by build_stores)
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # prefetch side stream
        self.entries: dict[ExpertKey, _Entry] = {key: _Entry() for key in sorted(reader.sources)}
        self.host_lru: collections.OrderedDict[ExpertKey, None] = collections.OrderedDict()
        # every key whose device or host copy came or went, in order: what readers consume instead of a walk
        self.journal: ChangeLog[ExpertKey] = ChangeLog(4 * len(self.entries))
        self.bytes_per_expert = reader.compute_bytes_per_expert  # what a copy holds in memory (pools count it)
        self.checkpoint_bytes_per_expert = reader.checkpoint_bytes_per_expert  # what a read takes from the files
        self.num_disk_reads = 0
        self.stacked_layers: set[int] = set()  # layers whose experts all sit in one resident stack (pinned)
        self.read_ahead = ReadAhead(self._verified_read, num_io_threads)
        self.is_disk_tiered = False  # some expert's only copy is the checkpoint on disk
        host_slots = self.staging_pool.budget_bytes // max(1, self.bytes_per_expert)
        # experts that may be read ahead at once; their host room is kept out of the cache's reach
        self.num_read_slots = min(READ_SLOTS, max(1, host_slots // 4)) if num_io_threads and host_slots >= 2 else 0
        self.pending_reads: list[tuple[ExpertKey, bool]] = []  # (key, is_predicted) waiting for a read slot
        self.pending_step_id = 0
        self.read_ahead_cached: set[ExpertKey] = set()  # host copies read ahead and not used yet: from disk
        self.stacked_spans: dict[int, tuple[int, int]] = {}  # stacked layer -> its contiguous slot range
        self.pending_ready: set[ExpertKey] = set()  # CUDA: placed on the copy stream, not yet waited for
        num_experts = collections.Counter(layer for layer, _ in self.entries)
        capacity = min(len(self.entries), device_pool.budget_bytes // max(1, self.bytes_per_expert))
        # every device copy is a slot of one stack (see slots.py); a slot's bytes are reserved while it is held
        self.slots = SlotPool(capacity, reader.matrix_shapes, reader.compute_dtype, device, dict(num_experts))

    def warm_host(self) -> int:
        """Fill the host cache in key order while it has room (what a fresh process would read first)."""
        num_read = 0
        for key in self.entries:
            if not self.host_pool.can_reserve(self.bytes_per_expert + self._read_slot_bytes()):
                break
            try:
                self._cache_on_host(key, self._read_disk(key)[0])
            except ExpertQuarantined:  # recorded; requests that route to it are told when they do
                continue
            num_read += 1
        self.is_disk_tiered = num_read < len(self.entries)
        self.read_ahead.end_step()  # warm-up reads are not a step's
        return num_read

    def queue_reads(self, needed: list[ExpertKey], predicted: list[ExpertKey], step_id: int) -> None:
        """Read ahead: the current layer's `needed` misses first, then the `predicted` experts of the next
        layer, replacing what an earlier layer queued; reads start as read slots free up (see `_pump`)."""
        if not self.num_read_slots:
            return
        queued = [(k, False) for k in needed] + [(k, True) for k in predicted if k not in set(needed)]
        self.pending_reads = [
            (k, is_p) for k, is_p in dict(queued).items() if self._is_disk_only(k) and k not in self.reader.quarantine
        ]
        self.pending_step_id = step_id
        self._pump()

    def close(self) -> None:
        """Stop the read threads and give back the host room of reads nobody took."""
        self.read_ahead.close()
        if self.lowbit_cache is not None:
            self.lowbit_cache.close()
        self.staging_pool.release(ObjectKind.EXPERT, len(self.read_ahead.flights) * self.bytes_per_expert)
        self.read_ahead.flights.clear()
        self.pending_reads.clear()

    def _is_disk_only(self, key: ExpertKey) -> bool:
        entry = self.entries[key]
        return entry.device is None and entry.host is None and not self.read_ahead.is_in_flight(key)

    def _pump(self) -> None:
        """Start queued reads while a read slot is free: each holds its expert's host bytes, in room the host
        cache leaves free for them (so a read ahead never evicts a cached expert)."""
        while self.pending_reads and len(self.read_ahead.flights) < self.num_read_slots:
            key, is_predicted = self.pending_reads.pop(0)
            if not self._is_disk_only(key) or not self.staging_pool.can_reserve(self.bytes_per_expert):
                continue
            self.staging_pool.reserve(ObjectKind.EXPERT, self.bytes_per_expert)
            self.read_ahead.start(key, self.pending_step_id, is_predicted)

    def _read_slot_bytes(self) -> int:
        """Host bytes the cache leaves free for read slots not in use."""
        return max(0, self.num_read_slots - len(self.read_ahead.flights)) * self.bytes_per_expert

    def settle_reads(self, step_id: int) -> None:
        """Reads started before `step_id` that nobody took become host-cache entries (their room was already
        reserved). Their first use reports the disk as its source, so the bytes are credited to the request
        that consumes them; one evicted unused is counted only in the transfer clock."""
        for key, weights in self.read_ahead.finished_before(step_id):
            entry = self.entries[key]
            is_room_kept = self.host_pool.free_bytes >= self._read_slot_bytes() + self.bytes_per_expert
            is_dropped = weights is None or entry.host is not None or entry.device is not None or not is_room_kept
            if is_dropped or self.is_ram_tiered:  # a CPU has no host cache to keep it in: read, then freed
                self.staging_pool.release(ObjectKind.EXPERT, self.bytes_per_expert)  # dropped: slots stay free
                continue
            entry.host = weights
            self.host_lru[key] = None
            self.journal.record(key)
            self.read_ahead_cached.add(key)

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
            if self.is_on_device(key) or not self.device_pool.can_reserve(self.bytes_per_expert):
                continue
            try:
                started.append((key, self.place(key, is_async=True)))
            except ExpertQuarantined:  # a prefetch found the fault: the requests that need it are told at use
                continue
        self.settle_reads(next_step_id)
        return started

    def stack_layers(self, modules: dict[int, torch.nn.Module]) -> None:
        """When the device budget holds every expert: put each layer's experts into one [E, 2I, H] and one
        [E, H, I] tensor on the device, held by the layer's experts module as its own parameters (so a
        layer runs as one grouped matmul, as transformers' `grouped_mm` does), every expert resident as a
        view into them and pinned there. Each expert is read from the checkpoint once, straight into place."""
        if self.slots.capacity < len(self.entries):
            raise EngineError(f"{self.slots.capacity} expert slots cannot stack all {len(self.entries)} experts")
        for layer, module in modules.items():
            keys = [key for key in self.entries if key[0] == layer]
            base = len(self.slots.slot_of)
            for key in keys:
                weights, slot = self._read_home(key, is_cached=False).weights, self.slots.assign(key, base + key[1])
                slot.gate_up.copy_(weights.gate_up)
                slot.down.copy_(weights.down)
                self.device_pool.reserve(ObjectKind.EXPERT, self.bytes_per_expert)
                self.entries[key].device = slot
                self.journal.record(key)
            gate_up, down = self.slots.gate_up[base : base + len(keys)], self.slots.down[base : base + len(keys)]
            module.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
            module.down_proj = torch.nn.Parameter(down, requires_grad=False)
            self.stacked_spans[layer] = (base, base + len(keys))
            self.stacked_layers.add(layer)

    # --- queries -------------------------------------------------------------------------------
    def home(self, key: ExpertKey) -> Tier:
        """Where a full-precision copy comes from: the host cache, or the checkpoint on disk."""
        entry = self.entries[key]
        return Tier.HOST if entry.host is not None or (self.is_aliased and entry.device is not None) else Tier.DISK

    def is_on_device(self, key: ExpertKey) -> bool:
        return self.entries[key].device is not None

    def has_lowbit(self, key: ExpertKey) -> bool:
        """True when a low-bit copy exists or can be made (it is made on first use)."""
        return self.lowbit_bits > 0

    def device_keys(self) -> list[ExpertKey]:
        return [key for key, entry in self.entries.items() if entry.device is not None]

    def device_weights(self, key: ExpertKey) -> ExpertWeights:
        entry = self.entries[key]
        if entry.device is None:
            raise EngineError(f"expert {key} used as resident but it is not on device")
        if entry.ready is not None:  # a prefetch on the copy stream: compute waits for it, not the host
            torch.cuda.current_stream().wait_event(entry.ready)
            entry.ready = None
            self.pending_ready.discard(key)
        return entry.device

    def wait_layer_ready(self, layer: int) -> None:
        """Make the compute stream wait for every copy-stream placement into `layer`'s slots."""
        for key in [k for k in self.pending_ready if k[0] == layer]:
            self.device_weights(key)

    def kernel_stack(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The slot stacks `layer`'s grouped kernel runs over, and the first slot they start at: a stacked
        layer's own contiguous range (as many groups as it has experts), else the whole pool."""
        span = self.stacked_spans.get(layer)
        if span is None:
            return self.slots.gate_up, self.slots.down, 0
        lo, hi = span
        return self.slots.gate_up[lo:hi], self.slots.down[lo:hi], lo

    @property
    def lowbit_scratch_bytes(self) -> int:
        """Device bytes an expert_lowbit computation holds at its peak: the low-bit copy as stored (codes,
        int4 packed two per byte, with fp32 scales and zero points), the weights in the compute dtype, and
        the working set of `dequantize_rows` (two fp32 buffers of DEQUANT_ROWS rows, and for int4 those
        rows' unpacked codes). Counted in the device pool as Scratch.EXPERT_DEQUANT while the expert runs."""
        bits, chunk = self.lowbit_bits or 8, self.reader.max_rows_numel(DEQUANT_ROWS)
        lowbit = lowbit_expert_nbytes(self.reader.matrix_shapes, bits)
        unpacked = chunk + DEQUANT_ROWS if bits == 4 else 0  # an odd row unpacks one padding code more
        return lowbit + self.bytes_per_expert + 2 * 4 * chunk + unpacked

    # --- mechanism -----------------------------------------------------------------------------
    def can_place(self, key: ExpertKey) -> bool:
        """True when `key` is on device already or its bytes fit in the device budget now."""
        return self.is_on_device(key) or self.device_pool.can_reserve(self.bytes_per_expert)

    def place(self, key: ExpertKey, is_async: bool = False) -> Fetched:
        """Bring `key` to device at full precision (exact_load).

        On CUDA with `is_async`, the copy runs on a side stream and overlaps compute; the first use waits
        for it on the GPU (see `device_weights`).
        """
        entry = self.entries[key]
        if entry.device is not None:
            return Fetched(self.device_weights(key), None, 0)
        fetched = self._read_home(key, is_cached=not self.is_in_place)
        if self.is_ram_tiered:
            self.drop_lowbit(self.bytes_per_expert)
        self.device_pool.reserve(ObjectKind.EXPERT, self.bytes_per_expert)
        if self.is_in_place and entry.host is not None:  # the host copy moves under the device budget
            self._drop_host(key)
        slot = self.slots.assign(key)
        if is_async and self.copy_stream is not None:
            self.copy_stream.wait_stream(torch.cuda.current_stream())  # the slot's last readers are done
            with torch.cuda.stream(self.copy_stream):
                _copy_into(slot, fetched.weights)
                entry.ready = torch.cuda.Event()
                entry.ready.record(self.copy_stream)
            self.pending_ready.add(key)
        else:
            _copy_into(slot, fetched.weights)
        entry.device = slot
        self.journal.record(key)
        return Fetched(entry.device, fetched.source_tier, fetched.bytes_moved, fetched.note)

    def evict(self, key: ExpertKey) -> None:
        """Drop the device copy of `key`; emulated, its bytes become the host cache's most recent entry; on a
        CPU they are freed (the checkpoint is its only other copy)."""
        entry = self.entries[key]
        if entry.device is None:
            raise EngineError(f"expert {key} is not on device; cannot evict")
        if key[0] in self.stacked_layers:
            raise EngineError(f"expert {key} sits in its layer's resident stack (everything fits); it is pinned")
        if entry.ready is not None:  # never free memory an in-flight side-stream copy still writes
            entry.ready.synchronize()
            entry.ready = None
            self.pending_ready.discard(key)
        weights, entry.device = entry.device, None
        self.device_pool.release(ObjectKind.EXPERT, self.bytes_per_expert)
        self.journal.record(key)
        if self.is_aliased:  # the bytes stay in RAM as the host cache's newest entry (one LRU over both)
            self._make_host_room()
            if self.host_pool.can_reserve(self.bytes_per_expert + self._read_slot_bytes()):
                with torch.inference_mode(False):  # a host copy like any read: a normal tensor
                    self._cache_on_host(key, ExpertWeights(weights.gate_up.clone(), weights.down.clone()))
        self.slots.release(key)

    def discard_copy(self, key: ExpertKey, tier: Tier) -> bool:
        """Drop a copy found corrupt without caching it anywhere (the next use reads the checkpoint); False
        for a copy pinned in its layer's resident stack."""
        entry = self.entries[key]
        if tier is Tier.HOST and entry.host is not None:
            self._drop_host(key)
            return True
        if tier is Tier.DEVICE and entry.device is not None:
            if key[0] in self.stacked_layers:
                return False
            if entry.ready is not None:
                entry.ready.synchronize()
                entry.ready = None
                self.pending_ready.discard(key)
            entry.device = None
            self.device_pool.release(ObjectKind.EXPERT, self.bytes_per_expert)
            self.journal.record(key)
            self.slots.release(key)
            return True
        return False

    def host_weights(self, key: ExpertKey) -> Fetched:
        """Full-precision weights in host memory for cpu_execute (read from the checkpoint when not cached)."""
        if self.is_ram_tiered:
            raise EngineError("cpu_execute is not offered where the device is the CPU: RAM is the only fast tier")
        entry = self.entries[key]
        if self.is_aliased and entry.device is not None:
            return Fetched(entry.device, None, 0)
        return self._read_home(key, is_cached=True)

    def lowbit_weights(self, key: ExpertKey) -> Fetched:
        """Dequantized low-bit copy (made now if it does not exist); bytes moved are the low-bit bytes (on a
        CPU only what was read from disk: a copy kept in RAM, or made from a resident one, moves nothing)."""
        entry, source, moved, note = self.entries[key], Tier.HOST, 0, ""
        if entry.lowbit is None:
            full = entry.device if self.is_in_place and entry.device is not None else None
            low = self.lowbit_cache.get(key) if full is None and self.lowbit_cache is not None else None
            if low is not None:  # persisted: a half or a quarter of the expert's bytes read from disk
                source, moved, note = Tier.DISK, low[0].num_bytes + low[1].num_bytes, "persisted low-bit copy"
            else:
                if full is None:
                    fetched = self._read_home(key, is_cached=False)
                    full, note = fetched.weights, fetched.note
                    if fetched.source_tier is Tier.DISK:
                        source, moved = Tier.DISK, fetched.bytes_moved
                low = (quantize(full.gate_up, self.lowbit_bits, axis=1), quantize(full.down, self.lowbit_bits, axis=1))
                if self.lowbit_cache is not None:
                    self.lowbit_cache.put(key, low)
            self._keep_lowbit(key, low)
        else:
            low = entry.lowbit
            if key in self.lowbit_lru:
                self.lowbit_lru.move_to_end(key)
        dtype = self.reader.compute_dtype
        weights = ExpertWeights(  # the low-bit bytes cross the link; dequantized where the expert runs
            dequantize_rows(quantized_to(low[0], self.device), dtype, DEQUANT_ROWS),
            dequantize_rows(quantized_to(low[1], self.device), dtype, DEQUANT_ROWS),
        )
        if self.is_ram_tiered:  # no link after the disk: the copy is computed with where it is, in RAM
            return Fetched(weights, Tier.DISK if moved else None, moved, note)
        return Fetched(weights, source, moved + low[0].num_bytes + low[1].num_bytes, note)

    def _keep_lowbit(self, key: ExpertKey, low: tuple[Quantized, Quantized]) -> None:
        """Keep a new low-bit copy while its pool has room: on CUDA full host copies make room (they can be
        re-read); on a CPU the RAM pool must have it free (nothing else is evicted for it)."""
        low_bytes = low[0].num_bytes + low[1].num_bytes
        if not self.is_ram_tiered:
            while self.host_lru and not self.host_pool.can_reserve(low_bytes):
                self._drop_host(next(iter(self.host_lru)))
        if self.lowbit_pool.can_reserve(low_bytes):
            self.lowbit_pool.reserve(self.lowbit_kind, low_bytes)
            self.entries[key].lowbit = low
            if self.is_ram_tiered:
                self.lowbit_lru[key] = None

    def drop_lowbit(self, num_bytes: int, is_done: Callable[[], bool] | None = None) -> int:
        """On a CPU: drop low-bit copies kept in RAM, least recently used first, until `is_done()` (default:
        `num_bytes` free in the RAM pool) or none is left; returns the number dropped (a copy is remade from
        the checkpoint on its next use)."""
        is_done = is_done or (lambda: self.device_pool.can_reserve(num_bytes))
        num_dropped = 0
        while self.lowbit_lru and not is_done():
            key, _ = self.lowbit_lru.popitem(last=False)
            low, self.entries[key].lowbit = self.entries[key].lowbit, None
            assert low is not None
            self.lowbit_pool.release(self.lowbit_kind, low[0].num_bytes + low[1].num_bytes)
            num_dropped += 1
        return num_dropped

    # --- host cache and disk -------------------------------------------------------------------
    def _read_home(self, key: ExpertKey, is_cached: bool) -> Fetched:
        entry = self.entries[key]
        if entry.host is not None:
            self.host_lru.move_to_end(key)
            if key in self.read_ahead_cached:  # read from the checkpoint ahead, in an earlier step
                self.read_ahead_cached.discard(key)
                return Fetched(entry.host, Tier.DISK, self.checkpoint_bytes_per_expert, "read ahead in an earlier step")
            return Fetched(entry.host, Tier.HOST, self.bytes_per_expert)
        weights, note = self._read_disk(key)
        if is_cached:
            self._make_host_room()
            if self.host_pool.can_reserve(self.bytes_per_expert + self._read_slot_bytes()):
                self._cache_on_host(key, weights)
        return Fetched(weights, Tier.DISK, self.checkpoint_bytes_per_expert, note)

    def _read_disk(self, key: ExpertKey) -> tuple[ExpertWeights, str]:
        """The expert from the checkpoint: a read started ahead (waited for), else a read now."""
        self.num_disk_reads += 1
        if self.read_ahead.is_in_flight(key):
            self.staging_pool.release(ObjectKind.EXPERT, self.bytes_per_expert)  # the caller places the bytes
            weights, note = self.read_ahead.take(key)
            self._pump()
            return weights, "; ".join(filter(None, ["read ahead", note]))
        return self.read_ahead.demand_read(key)

    def _verified_read(self, key: ExpertKey) -> tuple[ExpertWeights, str]:
        """A verified read; one re-read clears a transient fault, a second failure quarantines the expert
        (ExpertQuarantined)."""
        return read_checked(self.reader, key)

    def _cache_on_host(self, key: ExpertKey, weights: ExpertWeights) -> None:
        self.host_pool.reserve(ObjectKind.EXPERT, self.bytes_per_expert)
        self.entries[key].host = weights
        self.host_lru[key] = None
        self.journal.record(key)

    def _drop_host(self, key: ExpertKey) -> None:
        self.read_ahead_cached.discard(key)
        self.entries[key].host = None
        del self.host_lru[key]
        self.journal.record(key)
        self.host_pool.release(ObjectKind.EXPERT, self.bytes_per_expert)

    def _make_host_room(self) -> None:
        """Evict the least recently used host copy when the cache is full (it can be read again)."""
        while self.host_lru and not self.host_pool.can_reserve(self.bytes_per_expert + self._read_slot_bytes()):
            self._drop_host(next(iter(self.host_lru)))


def _copy_into(slot: ExpertWeights, weights: ExpertWeights) -> None:
    slot.gate_up.copy_(weights.gate_up, non_blocking=True)
    slot.down.copy_(weights.down, non_blocking=True)

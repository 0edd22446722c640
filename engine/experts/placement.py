"""Device copies of experts: placing one into a slot at full precision (exact_load and prefetch, on CUDA on the
copy stream), evicting or discarding one, waiting for copy-stream placements, and stacking every expert of a
layer into one resident tensor when everything fits (the device half of
:class:`~fallbackgate.engine.experts.store.ExpertStore`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from fallbackgate.engine.device_pool import Scratch, TierPool
from fallbackgate.engine.errors import EngineError
from fallbackgate.engine.experts import fp8_experts
from fallbackgate.engine.experts.host_cache import HostCache
from fallbackgate.engine.experts.journal import ChangeLog
from fallbackgate.engine.experts.quant import Quantized
from fallbackgate.engine.experts.slots import SlotPool
from fallbackgate.engine.experts.sources import ExpertKey
from fallbackgate.engine.experts.weights import ExpertWeights, Fetched, HeldWeights
from fallbackgate.engine.tags import ObjectKind, Tier


@dataclasses.dataclass(slots=True)
class ExpertEntry:
    """One expert's copies in each tier (the checkpoint on disk always holds it too)."""

    host: HeldWeights | None = None  # full-precision copy in the host cache (host pool); FP8: codes and scales
    device: ExpertWeights | None = None  # device copy (device pool); on CPU the former host tensors
    lowbit: tuple[Quantized, Quantized] | None = None  # int8/int4 copy in host memory, made on demand
    ready: torch.cuda.Event | None = None  # CUDA: set when an async (side-stream) copy completes


class DevicePlacement:
    """Places experts in device slots and takes them out of them, for
    :class:`~fallbackgate.engine.experts.store.ExpertStore`."""

    entries: dict[ExpertKey, ExpertEntry]
    device_pool: TierPool
    host_pool: TierPool
    slots: SlotPool
    host_cache: HostCache
    journal: ChangeLog[ExpertKey]
    bytes_per_expert: int
    dequant_scratch_bytes: int
    place_bytes: int
    is_moved_on_place: bool
    is_ram_tiered: bool
    is_aliased: bool
    copy_stream: torch.cuda.Stream | None
    pending_ready: set[ExpertKey]  # CUDA: placed on the copy stream, not yet waited for
    slot_freed: dict[int, torch.cuda.Event]  # CUDA: freed slot -> recorded on the compute stream when freed
    stacked_layers: set[int]  # layers whose experts all sit in one resident stack (pinned)
    stacked_spans: dict[int, tuple[int, int]]  # stacked layer -> its contiguous slot range
    is_on_device: Callable[[ExpertKey], bool]  # ExpertStore.is_on_device(key)
    drop_lowbit: Callable[[int], int]  # ExpertStore.drop_lowbit(num_bytes): RAM room from low-bit copies

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
                held, _ = self.host_cache.read_home_held(key, is_cached=False)
                slot = self.slots.assign(key, base + key[1])
                self.device_pool.reserve(ObjectKind.EXPERT, self.bytes_per_expert)
                with self.device_pool.held(Scratch.EXPERT_DEQUANT, self.dequant_scratch_bytes):
                    fp8_experts.write_into(slot, held)
                self.entries[key].device = slot
                self.journal.record(key)
            gate_up, down = self.slots.gate_up[base : base + len(keys)], self.slots.down[base : base + len(keys)]
            module.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
            module.down_proj = torch.nn.Parameter(down, requires_grad=False)
            self.stacked_spans[layer] = (base, base + len(keys))
            self.stacked_layers.add(layer)

    def device_weights(self, key: ExpertKey) -> ExpertWeights:
        """The device copy of `key` to compute with (the compute stream waits for a copy-stream placement)."""
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

    def can_place(self, key: ExpertKey) -> bool:
        """True when `key` is on device already or its bytes fit in the device budget now."""
        return self.is_on_device(key) or self.device_pool.can_reserve(self.place_bytes)

    def place(self, key: ExpertKey) -> Fetched:
        """Bring `key` to device at full precision (exact_load, or a prefetch).

        On CUDA the copy runs on the copy stream and overlaps compute; the expert's first use waits for it on
        the GPU (see `device_weights`). An FP8 copy is dequantized into the slot as it is written, its
        temporaries counted in the device pool as Scratch.EXPERT_DEQUANT meanwhile.
        """
        entry = self.entries[key]
        if entry.device is not None:
            return Fetched(self.device_weights(key), None, 0)
        held, fetched = self.host_cache.read_home_held(key, is_cached=not self.is_moved_on_place)
        if self.is_ram_tiered:
            self.drop_lowbit(self.place_bytes)
        self.device_pool.reserve(ObjectKind.EXPERT, self.bytes_per_expert)
        if self.is_moved_on_place and entry.host is not None:  # the host copy moves under the device budget
            self.host_cache.drop(key)
        slot = self.slots.assign(key)
        with self.device_pool.held(Scratch.EXPERT_DEQUANT, self.dequant_scratch_bytes):
            if self.copy_stream is not None:
                self._copy_on_stream(key, slot, held)
            else:
                fp8_experts.write_into(slot, held)
        entry.device = slot
        self.journal.record(key)
        return Fetched(entry.device, fetched.source_tier, fetched.bytes_moved, fetched.note)

    def _copy_on_stream(self, key: ExpertKey, slot: ExpertWeights, held: HeldWeights) -> None:
        """CUDA: write `held` into `slot` on the copy stream once the slot's last reader is done (an asynchronous
        DMA from a page-locked host copy); the compute stream waits for it at the expert's first use
        (`device_weights`, `wait_layer_ready`), the host does not."""
        index = self.slots.slot_of[key]
        freed = self.slot_freed.pop(index, None)
        assert self.copy_stream is not None
        if freed is not None:
            self.copy_stream.wait_event(freed)
        with torch.cuda.stream(self.copy_stream):
            fp8_experts.write_into(slot, held)
            ready = self.entries[key].ready = torch.cuda.Event()
            ready.record(self.copy_stream)
        if self.host_cache.pinner is not None:
            self.host_cache.pinner.record_copy(held, self.copy_stream)
        self.pending_ready.add(key)

    def _release_slot(self, key: ExpertKey) -> None:
        """Free `key`'s slot; on CUDA note when the kernels queued so far (its last readers) are done."""
        if self.copy_stream is not None:
            freed = self.slot_freed[self.slots.slot_of[key]] = torch.cuda.Event()
            freed.record(torch.cuda.current_stream())
        self.slots.release(key)

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
        if self.is_aliased and self.is_moved_on_place:  # the bytes stay in RAM as the host cache's newest entry
            self.host_cache.make_room()
            if self.host_pool.can_reserve(self.bytes_per_expert + self.host_cache.read_slot_bytes()):
                with torch.inference_mode(False):  # a host copy like any read: a normal tensor
                    self.host_cache.cache(key, ExpertWeights(weights.gate_up.clone(), weights.down.clone()))
        self._release_slot(key)

    def discard_copy(self, key: ExpertKey, tier: Tier) -> bool:
        """Drop a copy found corrupt without caching it anywhere (the next use reads the checkpoint); False
        for a copy pinned in its layer's resident stack."""
        entry = self.entries[key]
        if tier is Tier.HOST and entry.host is not None:
            self.host_cache.drop(key)
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
            self._release_slot(key)
            return True
        return False

"""Tiered expert store: every routed expert has a full-precision home on host or disk, and may be
cached on device. Mechanism only: callers decide what to place and what to evict."""

from __future__ import annotations

import dataclasses

import torch

from fallbackgate.engine.device_pool import TierPool
from fallbackgate.engine.errors import ChecksumError, EngineError
from fallbackgate.engine.quant import Quantized, dequantize, quantize, quantized_to
from fallbackgate.engine.spill import SpillDir, SpillRecord
from fallbackgate.engine.tags import ObjectKind, Tier

ExpertKey = tuple[int, int]  # (layer, expert_id)


@dataclasses.dataclass(slots=True)
class ExpertWeights:
    """One routed expert's matrices in transformers' layout."""

    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


@dataclasses.dataclass(slots=True)
class Fetched:
    """Weights handed to a caller, with what it cost to get them."""

    weights: ExpertWeights  # ready to compute with
    source_tier: Tier | None  # where bytes came from (None: nothing moved)
    bytes_moved: int  # bytes read over a link
    note: str = ""  # e.g. a recovered checksum failure


@dataclasses.dataclass(slots=True)
class _Entry:
    home: Tier  # HOST or DISK
    host: ExpertWeights | None = None  # present when home is HOST
    disk: tuple[SpillRecord, SpillRecord] | None = None  # (gate_up, down) primary files
    replica: tuple[SpillRecord, SpillRecord] | None = None  # second copy, read when a page fails
    device: ExpertWeights | None = None  # cached device copy
    lowbit: tuple[Quantized, Quantized] | None = None  # int8/int4 copy kept in host memory
    ready: torch.cuda.Event | None = None  # CUDA: set when an async (side-stream) copy completes


class ExpertStore:
    """Holds every routed expert of the model; the modules keep no expert weights of their own."""

    def __init__(
        self,
        experts_by_layer: dict[int, torch.nn.Module],
        device_pool: TierPool,
        host_pool: TierPool,
        spill: SpillDir,
        device: torch.device,
        lowbit_bits: int = 8,
    ) -> None:
        self.device_pool, self.host_pool, self.spill, self.device = device_pool, host_pool, spill, device
        self.lowbit_bits = lowbit_bits
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # prefetch side stream
        self.entries: dict[ExpertKey, _Entry] = {}
        first = next(iter(experts_by_layer.values()))
        self.bytes_per_expert = (first.gate_up_proj[0].numel() + first.down_proj[0].numel()) * 4
        for layer, module in sorted(experts_by_layer.items()):
            for expert_id in range(module.num_experts):
                self._take_home(layer, expert_id, module)
            empty = torch.nn.Parameter(torch.empty(0), requires_grad=False)
            module.gate_up_proj, module.down_proj = empty, torch.nn.Parameter(torch.empty(0), requires_grad=False)

    def _take_home(self, layer: int, expert_id: int, module: torch.nn.Module) -> None:
        weights = ExpertWeights(
            module.gate_up_proj.data[expert_id].detach().float().clone(),
            module.down_proj.data[expert_id].detach().float().clone(),
        )
        if self.host_pool.can_reserve(self.bytes_per_expert):
            self.host_pool.reserve(ObjectKind.EXPERT, self.bytes_per_expert)
            if self.device.type == "cuda":
                weights = ExpertWeights(weights.gate_up.pin_memory(), weights.down.pin_memory())
            entry = _Entry(home=Tier.HOST, host=weights)
        else:
            name = f"expert-L{layer}-E{expert_id}"
            entry = _Entry(home=Tier.DISK)
            entry.disk = (self.spill.write(name + "-gu", weights.gate_up), self.spill.write(name + "-dn", weights.down))
            entry.replica = (
                self.spill.write(name + "-gu.r", weights.gate_up),
                self.spill.write(name + "-dn.r", weights.down),
            )
        if self.lowbit_bits:
            low = (
                quantize(weights.gate_up, self.lowbit_bits, axis=1),
                quantize(weights.down, self.lowbit_bits, axis=1),
            )
            low_bytes = low[0].num_bytes + low[1].num_bytes
            if self.host_pool.can_reserve(low_bytes):
                self.host_pool.reserve(ObjectKind.EXPERT, low_bytes)
                entry.lowbit = low
        self.entries[(layer, expert_id)] = entry

    # --- queries -------------------------------------------------------------------------------
    def home(self, key: ExpertKey) -> Tier:
        return self.entries[key].home

    def is_on_device(self, key: ExpertKey) -> bool:
        return self.entries[key].device is not None

    def has_lowbit(self, key: ExpertKey) -> bool:
        return self.entries[key].lowbit is not None

    def device_keys(self) -> list[ExpertKey]:
        return [key for key, entry in self.entries.items() if entry.device is not None]

    def device_weights(self, key: ExpertKey) -> ExpertWeights:
        entry = self.entries[key]
        if entry.device is None:
            raise EngineError(f"expert {key} used as resident but it is not on device")
        if entry.ready is not None:  # a prefetch on the copy stream: compute waits for it, not the host
            torch.cuda.current_stream().wait_event(entry.ready)
            entry.ready = None
        return entry.device

    # --- mechanism -----------------------------------------------------------------------------
    def can_place(self, key: ExpertKey) -> bool:
        """True when `key` is on device already or its bytes fit in the device budget now."""
        return self.is_on_device(key) or self.device_pool.can_reserve(self.bytes_per_expert)

    def place(self, key: ExpertKey, is_async: bool = False) -> Fetched:
        """Copy `key` from its home to device at full precision (exact_load).

        On CUDA with `is_async`, the copy runs on a side stream from pinned memory and overlaps compute;
        the first use waits for it on the GPU (see `device_weights`).
        """
        entry = self.entries[key]
        if entry.device is not None:
            return Fetched(self.device_weights(key), None, 0)
        fetched = self._read_home(key)
        self.device_pool.reserve(ObjectKind.EXPERT, self.bytes_per_expert)
        weights = fetched.weights
        if is_async and self.copy_stream is not None:
            with torch.cuda.stream(self.copy_stream):
                entry.device = self._copy_to_device(weights)
                entry.ready = torch.cuda.Event()
                entry.ready.record(self.copy_stream)
        else:
            entry.device = self._copy_to_device(weights)
        return Fetched(entry.device, fetched.source_tier, self.bytes_per_expert, fetched.note)

    def _copy_to_device(self, weights: ExpertWeights) -> ExpertWeights:
        return ExpertWeights(
            weights.gate_up.to(self.device, copy=True, non_blocking=True),
            weights.down.to(self.device, copy=True, non_blocking=True),
        )

    def evict(self, key: ExpertKey) -> None:
        """Drop the device copy of `key` (its home copy stays)."""
        entry = self.entries[key]
        if entry.device is None:
            raise EngineError(f"expert {key} is not on device; cannot evict")
        if entry.ready is not None:  # never free memory an in-flight side-stream copy still writes
            entry.ready.synchronize()
            entry.ready = None
        entry.device = None
        self.device_pool.release(ObjectKind.EXPERT, self.bytes_per_expert)

    def host_weights(self, key: ExpertKey) -> Fetched:
        """Full-precision weights in host memory for cpu_execute (read from disk when homed there)."""
        return self._read_home(key)

    def lowbit_weights(self, key: ExpertKey) -> Fetched:
        """Dequantized low-bit copy; bytes moved are the low-bit bytes."""
        low = self.entries[key].lowbit
        if low is None:
            raise EngineError(f"expert {key} has no low-bit copy")
        weights = ExpertWeights(  # the low-bit bytes cross the link; dequantized where the expert runs
            dequantize(quantized_to(low[0], self.device)), dequantize(quantized_to(low[1], self.device))
        )
        return Fetched(weights, Tier.HOST, low[0].num_bytes + low[1].num_bytes)

    def _read_home(self, key: ExpertKey) -> Fetched:
        entry = self.entries[key]
        if entry.host is not None:
            return Fetched(entry.host, Tier.HOST, self.bytes_per_expert)
        assert entry.disk is not None and entry.replica is not None
        try:
            weights = ExpertWeights(self.spill.read(entry.disk[0]), self.spill.read(entry.disk[1]))
            return Fetched(weights, Tier.DISK, self.bytes_per_expert)
        except ChecksumError as exc:
            weights = ExpertWeights(self.spill.read(entry.replica[0]), self.spill.read(entry.replica[1]))
            note = f"checksum failure ({exc}); recovered exactly from the replica"
            return Fetched(weights, Tier.DISK, 2 * self.bytes_per_expert, note)

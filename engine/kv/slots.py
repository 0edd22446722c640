"""One tier's KV blocks in pooled tensors: per layer one [kv_heads, capacity, block_size, width] tensor.

A block held in a tier occupies one slot of its layer's tensor; its block-table entry is the slot index,
and a request's slots of a layer, as an index tensor, gather its K/V in one copy straight into the
[kv_heads, tokens, width] layout attention reads (vLLM's block tables; heads outermost so that the
gathered blocks are already contiguous per head). Slot
tensors are allocated with `torch.empty` (a CPU allocation's untouched pages are not resident) and grow
by doubling, up to `max_slots`, when a layer's slots run out; the budget is counted by the caller in
its TierPool per slot taken, never by capacity.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fallbackgate.engine.errors import BudgetError

MIN_SLOTS = 4  # a layer's first capacity at least


class SlotTier:
    """Per-layer slot tensors and free lists of one tier (device or host)."""

    def __init__(
        self,
        name: str,
        num_layers: int,
        block_shape: tuple[int, int, int],
        dtype: torch.dtype,
        device: torch.device,
        initial_slots: int,
        max_slots: int,
    ) -> None:
        """`initial_slots` per layer are allocated at once (at least MIN_SLOTS, at most `max_slots`). A host
        tier is pageable on CUDA too: locked, every slot of a tensor's capacity would be resident and uncounted,
        and a block (a strided view) is copied through a pageable contiguous buffer anyway."""
        self.name, self.block_shape, self.dtype, self.device = name, block_shape, dtype, device
        self.max_slots = max(1, int(max_slots))
        capacity = min(self.max_slots, max(MIN_SLOTS, int(initial_slots)))
        self.tensors = [self._allocate(capacity) for _ in range(num_layers)]
        self.free_slots: list[list[int]] = [list(range(capacity - 1, -1, -1)) for _ in range(num_layers)]
        self.on_moved: list[Callable[[int, torch.Tensor], None]] = []  # told (layer, new tensor) after growth
        self.num_grown = 0  # times a layer's tensor was reallocated larger

    def _allocate(self, capacity: int) -> torch.Tensor:
        heads, block_size, width = self.block_shape
        return torch.empty((heads, capacity, block_size, width), dtype=self.dtype, device=self.device)

    @property
    def capacity_bytes(self) -> int:
        """Bytes the slot tensors span (allocated; on a CPU only the touched pages are resident)."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def num_slots(self) -> int:
        """Slots per layer now (the first layer's; layers grow independently)."""
        return self.tensors[0].shape[1] if self.tensors else 0

    def take(self, layer: int) -> int:
        """A free slot of `layer` (growing its tensor when none is left)."""
        free = self.free_slots[layer]
        if not free:
            self._grow(layer)
        return free.pop()

    def give_back(self, layer: int, slot: int) -> None:
        self.free_slots[layer].append(slot)

    def view(self, layer: int, slot: int) -> torch.Tensor:
        """The slot's [kv_heads, block_size, width] block (a view into the layer's tensor)."""
        return self.tensors[layer][:, slot]

    def gather_into(self, layer: int, slots: list[int], out: torch.Tensor) -> None:
        """Copy the slots' blocks, in order, into `out` [kv_heads, len(slots), block_size, width] (one index)."""
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        torch.index_select(self.tensors[layer], 1, index, out=out)

    def _grow(self, layer: int) -> None:
        old = self.tensors[layer]
        capacity = old.shape[1]
        if capacity >= self.max_slots:
            raise BudgetError(f"{self.name} KV slots of layer {layer}: all {capacity} taken (what the budget holds)")
        new_capacity = min(self.max_slots, 2 * capacity)
        grown = self._allocate(new_capacity)
        grown[:, :capacity].copy_(old)
        self.tensors[layer] = grown
        self.free_slots[layer].extend(range(new_capacity - 1, capacity - 1, -1))
        self.num_grown += 1
        for callback in self.on_moved:
            callback(layer, grown)

"""The slot-stacked expert pool: every expert the device tier holds sits in one slot of two stacked tensors
(``[S, 2I, H]`` gate_up and ``[S, H, I]`` down), so a layer's experts — resident or just loaded — compute in
one grouped matmul over the pool, the kernel transformers' ``grouped_mm`` path runs on stacked weights.

A slot's bytes are counted in the device budget while an expert occupies it (the store reserves and
releases them); the pool only maps experts to slots. Per layer a table maps expert id -> slot (-1 when the
expert is not on device), kept on the device so routing is translated to slots without a host sync.
"""

from __future__ import annotations

import torch

from fallbackgate.engine.errors import EngineError
from fallbackgate.engine.experts.weights import ExpertWeights

ExpertKey = tuple[int, int]


class SlotPool:
    """`capacity` expert slots of one shape and dtype on `device`, and per layer the expert -> slot table."""

    def __init__(
        self,
        capacity: int,
        shapes: tuple[tuple[int, int], tuple[int, int]],
        dtype: torch.dtype,
        device: torch.device,
        num_experts_by_layer: dict[int, int],
    ) -> None:
        (gate_up_rows, gate_up_cols), (down_rows, down_cols) = shapes
        self.capacity = capacity
        # untouched slots cost no physical memory on a CPU (pages are committed when written)
        self.gate_up = torch.empty((capacity, gate_up_rows, gate_up_cols), dtype=dtype, device=device)
        self.down = torch.empty((capacity, down_rows, down_cols), dtype=dtype, device=device)
        self.free: list[int] = list(range(capacity - 1, -1, -1))  # pop() hands out the lowest slot first
        self.slot_of: dict[ExpertKey, int] = {}
        self.tables = {
            layer: torch.full((n,), -1, dtype=torch.int64, device=device) for layer, n in num_experts_by_layer.items()
        }

    def assign(self, key: ExpertKey, slot: int | None = None) -> ExpertWeights:
        """Give `key` a free slot (`slot` when named) and return views of it to fill."""
        if key in self.slot_of:
            raise EngineError(f"expert {key} already holds slot {self.slot_of[key]}")
        if not self.free:
            raise EngineError(f"every one of the {self.capacity} expert slots is taken")
        if slot is None:
            slot = self.free.pop()
        else:
            self.free.remove(slot)
        self.slot_of[key] = slot
        self.tables[key[0]][key[1]] = slot
        return self.weights(slot)

    def release(self, key: ExpertKey) -> None:
        """Free `key`'s slot (its bytes are reused by the next expert placed)."""
        slot = self.slot_of.pop(key)
        self.tables[key[0]][key[1]] = -1
        self.free.append(slot)

    def weights(self, slot: int) -> ExpertWeights:
        """Views of one slot's matrices."""
        return ExpertWeights(self.gate_up[slot], self.down[slot])

    def table(self, layer: int) -> torch.Tensor:
        """Expert id -> slot (-1: not on device) for `layer`, on the pool's device."""
        return self.tables[layer]

"""Byte-accurate accounting of one memory tier's budget, shared by expert slots, KV blocks and scratch."""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator

from fallbackgate.engine.errors import BudgetError
from fallbackgate.engine.tags import ObjectKind


class Scratch(str, enum.Enum):
    """Short-lived device buffers that the budget counts next to expert slots and KV blocks."""

    KV_STAGED = "kv_staged"  # an off-device KV block made readable for one step (loaded, dequantized, rebuilt)
    KV_GATHER = "kv_gather"  # one layer's K/V of the packed requests laid out contiguously for attention
    KV_EXPAND = "kv_expand"  # one request's MLA latents expanded to every head's K/V for one layer's attention
    EXPERT_DEQUANT = "expert_dequant"  # a low-bit expert's transfer copy and dequantized weights; FP8 dequant staging
    EXPERT_LOWBIT_READ = "expert_lowbit_read"  # a persisted low-bit copy's read buffer while it is read ahead of use
    EXPERT_PIN = "expert_pin"  # host: a read's pageable bytes while they are copied into page-locked memory
    KV_WRITE_BEHIND = "kv_write_behind"  # RAM: a spilled KV block's bytes while its disk write is in flight


class HeldCopy(str, enum.Enum):
    """Copies a pool holds beside the objects steps compute with."""

    EXPERT_LOWBIT = "expert_lowbit"  # a kept low-bit expert copy (CPU: in the one RAM budget)


PoolKind = ObjectKind | Scratch | HeldCopy


class TierPool:
    """A byte budget; holders reserve and release exact byte counts per kind of holding."""

    def __init__(self, name: str, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise BudgetError(f"{name} budget must be >= 0 bytes, got {budget_bytes}")
        self.name = name
        self.budget_bytes = int(budget_bytes)
        kinds: list[PoolKind] = [*ObjectKind, *Scratch, *HeldCopy]
        self.used_bytes_by_kind: dict[PoolKind, int] = {kind: 0 for kind in kinds}
        self.peak_bytes_by_kind: dict[PoolKind, int] = {kind: 0 for kind in kinds}  # per kind, each its own peak
        self.peak_used_bytes = 0  # the most ever held at once, all kinds together

    @property
    def used_bytes(self) -> int:
        return sum(self.used_bytes_by_kind.values())

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes

    def can_reserve(self, num_bytes: int) -> bool:
        """True when `num_bytes` more fit in the budget."""
        return num_bytes <= self.free_bytes

    def reserve(self, kind: PoolKind, num_bytes: int) -> None:
        """Take `num_bytes` for a holding of `kind`; the caller checked `can_reserve`."""
        if not self.can_reserve(num_bytes):
            raise BudgetError(f"{self.name}: reserving {num_bytes} B with only {self.free_bytes} B free")
        self.used_bytes_by_kind[kind] += num_bytes
        self.peak_bytes_by_kind[kind] = max(self.peak_bytes_by_kind[kind], self.used_bytes_by_kind[kind])
        self.peak_used_bytes = max(self.peak_used_bytes, self.used_bytes)

    def release(self, kind: PoolKind, num_bytes: int) -> None:
        """Give back bytes reserved earlier for `kind`."""
        if num_bytes > self.used_bytes_by_kind[kind]:
            raise BudgetError(
                f"{self.name}: releasing {num_bytes} B of {kind.value} but only "
                f"{self.used_bytes_by_kind[kind]} B are held"
            )
        self.used_bytes_by_kind[kind] -= num_bytes

    @contextlib.contextmanager
    def held(self, kind: PoolKind, num_bytes: int) -> Iterator[None]:
        """Reserve `num_bytes` of `kind` for the duration of a block (a transient buffer)."""
        self.reserve(kind, num_bytes)
        try:
            yield
        finally:
            self.release(kind, num_bytes)

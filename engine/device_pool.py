"""Byte-accurate accounting of one memory tier's budget, shared by expert slots and KV blocks."""

from __future__ import annotations

from fallbackgate.engine.errors import BudgetError
from fallbackgate.engine.tags import ObjectKind


class TierPool:
    """A byte budget; holders reserve and release exact byte counts per object kind."""

    def __init__(self, name: str, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise BudgetError(f"{name} budget must be >= 0 bytes, got {budget_bytes}")
        self.name = name
        self.budget_bytes = int(budget_bytes)
        self.used_bytes_by_kind: dict[ObjectKind, int] = {kind: 0 for kind in ObjectKind}
        self.peak_used_bytes = 0  # the most ever held at once

    @property
    def used_bytes(self) -> int:
        return sum(self.used_bytes_by_kind.values())

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes

    def can_reserve(self, num_bytes: int) -> bool:
        """True when `num_bytes` more fit in the budget."""
        return num_bytes <= self.free_bytes

    def reserve(self, kind: ObjectKind, num_bytes: int) -> None:
        """Take `num_bytes` for an object of `kind`; the caller checked `can_reserve`."""
        if not self.can_reserve(num_bytes):
            raise BudgetError(f"{self.name}: reserving {num_bytes} B with only {self.free_bytes} B free")
        self.used_bytes_by_kind[kind] += num_bytes
        self.peak_used_bytes = max(self.peak_used_bytes, self.used_bytes)

    def release(self, kind: ObjectKind, num_bytes: int) -> None:
        """Give back bytes reserved earlier for `kind`."""
        if num_bytes > self.used_bytes_by_kind[kind]:
            raise BudgetError(
                f"{self.name}: releasing {num_bytes} B of {kind.value} but only "
                f"{self.used_bytes_by_kind[kind]} B are held"
            )
        self.used_bytes_by_kind[kind] -= num_bytes

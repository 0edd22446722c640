"""The memory this process really has, and the RAM budget sized from it when no budget is given.

On a CPU-only machine RAM is the one fast tier: experts, their low-bit copies, KV blocks and scratch share
one budget. Without a budget flag it is the memory limit (a cgroup's, v2 or v1, or physical RAM, whichever is
smaller) minus the dense weights and a stated margin for the interpreter, libraries and allocator slack.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

MIB = 1024 * 1024
MARGIN_FIXED_BYTES = 512 * MIB  # Python, torch and the tokenizer (~0.4 GiB resident measured after import)
MARGIN_FRACTION = 0.10  # allocator slack and buffers no pool counts (activations, the ledger's queue)
CGROUP_V2_LIMIT = pathlib.Path("/sys/fs/cgroup/memory.max")
CGROUP_V1_LIMIT = pathlib.Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")


@dataclasses.dataclass(slots=True, frozen=True)
class MemoryLimit:
    """How much memory the process may use, and where that number comes from."""

    num_bytes: int  # the binding limit
    source: str  # "cgroup v2 memory.max", "cgroup v1 memory.limit_in_bytes" or "physical RAM"


@dataclasses.dataclass(slots=True, frozen=True)
class SizedBudget:
    """A RAM budget sized from the memory limit: limit - dense - margin."""

    budget_bytes: int  # what the one RAM pool gets (>= 0)
    limit: MemoryLimit  # the memory the process has
    dense_bytes: int  # dense weights, resident outside the budget
    margin_bytes: int  # MARGIN_FIXED_BYTES + MARGIN_FRACTION of the limit

    def describe(self) -> str:
        """One line for the run summary."""
        return (
            f"RAM budget {self.budget_bytes / MIB:.1f} MiB sized from {self.limit.source} "
            f"{self.limit.num_bytes / MIB:.0f} MiB minus dense weights {self.dense_bytes / MIB:.1f} MiB "
            f"minus margin {self.margin_bytes / MIB:.0f} MiB ({MARGIN_FIXED_BYTES // MIB} MiB + "
            f"{MARGIN_FRACTION:.0%} of the limit)"
        )


def _read_limit(path: pathlib.Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def physical_ram_bytes() -> int:
    """Physical RAM of the machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_limit(v2: pathlib.Path = CGROUP_V2_LIMIT, v1: pathlib.Path = CGROUP_V1_LIMIT) -> MemoryLimit:
    """The smaller of the memory cgroup's limit (v2, else v1) and physical RAM (an unset v1 limit reads as a
    huge number, larger than RAM)."""
    physical = physical_ram_bytes()
    for path, source in ((v2, "cgroup v2 memory.max"), (v1, "cgroup v1 memory.limit_in_bytes")):
        limit = _read_limit(path)
        if limit is not None:
            return MemoryLimit(limit, source) if limit < physical else MemoryLimit(physical, "physical RAM")
    return MemoryLimit(physical, "physical RAM")


def size_ram_budget(dense_bytes: int, limit: MemoryLimit | None = None) -> SizedBudget:
    """The RAM budget without a budget flag: the limit minus the dense weights and the margin (>= 0)."""
    limit = limit or memory_limit()
    margin = MARGIN_FIXED_BYTES + int(MARGIN_FRACTION * limit.num_bytes)
    return SizedBudget(max(0, limit.num_bytes - dense_bytes - margin), limit, dense_bytes, margin)

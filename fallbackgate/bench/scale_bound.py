"""The roofline of ``fallbackgate.bench.scale``: the engine's tokens/s can be no better than
``min(in-memory tokens/s, tokens/s if the bytes Belady's MIN must read came at the best measured disk rate)``.

Belady's MIN is counted on the engine's own expert-access trace at the number of experts its RAM budget holds
(every slot for experts: a bound); the disk rate is `DiskTable.best_read_bytes_per_s` at the engine's read
size (one read per expert tensor), the best over the measured queue depths (1-32) of ``fallbackgate profile``'s
disk table.
"""

from __future__ import annotations

from typing import Any

from fallbackgate.engine.disk_model import DiskTable
from fallbackgate.sweep.belady import belady_misses, lru_misses


def roofline_tokens_per_s(
    in_memory_tokens_per_s: float, num_tokens: int, belady_read_bytes: int, disk_bytes_per_s: float
) -> float:
    """``min(in_memory_tokens_per_s, num_tokens / (belady_read_bytes / disk_bytes_per_s))``; no bytes to read:
    the in-memory rate."""
    if belady_read_bytes <= 0:
        return in_memory_tokens_per_s
    return min(in_memory_tokens_per_s, num_tokens * disk_bytes_per_s / belady_read_bytes)


def roofline(engine: dict[str, Any], in_memory_tokens_per_s: float, table: DiskTable) -> dict[str, Any]:
    """The roofline for one capped engine run (`engine`: scale_child's JSON) and its parts."""
    trace = [tuple(k) for k in engine["trace"]]
    slots = int(engine["num_expert_slots"])
    misses = belady_misses(trace, slots)
    read_bytes = misses * int(engine["checkpoint_bytes_per_expert"])
    rate = table.best_read_bytes_per_s(int(engine["expert_io_bytes"]))
    tokens = int(engine["num_output_tokens"])
    disk_only = tokens * rate / read_bytes if read_bytes else float("inf")
    return {
        "num_expert_slots": slots,
        "num_expert_uses": len(trace),
        "belady_misses": misses,
        "lru_misses": lru_misses(trace, slots),
        "engine_disk_reads": engine["num_expert_disk_reads"],
        "belady_read_bytes": read_bytes,
        "io_bytes": engine["expert_io_bytes"],
        "best_read_bytes_per_s": rate,
        "disk_tokens_per_s": disk_only,
        "in_memory_tokens_per_s": in_memory_tokens_per_s,
        "tokens_per_s": roofline_tokens_per_s(in_memory_tokens_per_s, tokens, read_bytes, rate),
    }

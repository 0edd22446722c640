"""Anonymous mappings for expert reads, recycled once no tensor views them.

A fresh mapping costs the kernel a page fault and a zeroed page per 4 KiB before ``O_DIRECT`` can fill it:
on a 2-core machine that measured ~6 ms of CPU per 12.6 MB expert, as much as the compute it should overlap.
A mapping whose bytes no tensor references any more (Python's reference count of the mapping says so:
each ``torch.frombuffer`` storage holds one) is handed to the next read of its size instead; at most
``max_idle`` idle mappings per size are kept, the rest unmapped.
"""

from __future__ import annotations

import mmap
import sys
import threading

GRANULE = 64 * 1024  # mapping sizes are rounded up to this, so reads of one expert size share mappings


def _idle_reference_count() -> int:
    """References an unused mapping has inside `SpanPool.get`'s scan (its list, the loop name, the call)."""
    group = [mmap.mmap(-1, mmap.PAGESIZE)]
    return [sys.getrefcount(m) for m in group][0]


_IDLE_REFS = _idle_reference_count()


class SpanPool:
    """Mappings by rounded size; thread-safe (I/O threads read ahead)."""

    def __init__(self, max_idle: int = 8) -> None:
        self.max_idle = max_idle
        self.groups: dict[int, list[mmap.mmap]] = {}
        self.lock = threading.Lock()
        self.num_created = 0
        self.num_reused = 0

    def get(self, num_bytes: int) -> mmap.mmap:
        """A mapping of at least `num_bytes` that nothing else uses."""
        size = -(-max(num_bytes, 1) // GRANULE) * GRANULE
        with self.lock:
            group = self.groups.setdefault(size, [])
            idle = [m for m in group if sys.getrefcount(m) == _IDLE_REFS]
            for extra in idle[self.max_idle :]:
                group.remove(extra)
                extra.close()
            if idle:
                self.num_reused += 1
                return idle[0]
            mapping = mmap.mmap(-1, size)
            group.append(mapping)
            self.num_created += 1
            return mapping

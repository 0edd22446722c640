"""Reading a layer's persisted low-bit expert copies ahead of their use (CPU, RAM and disk).

A layer's `expert_lowbit` uses run one expert at a time after its exact rows. Their persisted copies are
queued on the disk's one I/O queue before the exact rows compute, at most `window` at a time, so each arrives
while the kernel or the previous low-bit expert runs. Each read lands in a buffer of the store's
`lowbit_read_bytes`, counted in the RAM budget as ``Scratch.EXPERT_LOWBIT_READ`` until its use takes the copy.
Room for the first window is made in the controller's victim order, as for a copy's dequantization scratch
(nothing is placed before the layer's rows are computed, so an expert evicted now is read in place); a later
read starts only in room already free, and a read that does not fit is read at its use.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from fallbackgate.engine.device_pool import Scratch
from fallbackgate.engine.experts.store import ExpertKey, ExpertStore
from fallbackgate.engine.io.context import IOPriority, io_context

READ_AHEAD_WINDOW = 2  # persisted low-bit copies in flight at once per layer


class LowbitReadAhead:
    """The low-bit reads of one layer at a time: `start`, `took` per use, `settle` at the layer's end."""

    def __init__(self, store: ExpertStore, window: int = READ_AHEAD_WINDOW) -> None:
        self.store, self.window = store, window
        self.waiting: collections.deque[tuple[ExpertKey, tuple[str, ...]]] = collections.deque()  # not started
        self.in_flight: set[ExpertKey] = set()  # started, buffer held, not yet taken

    def start(self, keys: dict[ExpertKey, tuple[str, ...]], make_room: Callable[[int], object]) -> None:
        """Queue the reads of `keys` (each with the requests it serves) whose next low-bit run reads a
        persisted copy, starting the first window; `make_room(num_bytes)` frees room in the victim order."""
        num_bytes = self.store.lowbit_read_bytes
        self.waiting.extend((key, ids) for key, ids in keys.items() if self.store.is_lowbit_read_from_disk(key))
        if not self.waiting or not num_bytes:
            self.waiting.clear()
            return
        make_room(min(len(self.waiting), self.window) * num_bytes)
        self._start_next()

    def took(self, key: ExpertKey) -> None:
        """`key`'s copy was taken by its use: its buffer is released and the next read starts in its room."""
        if key in self.in_flight:
            self.in_flight.discard(key)
            self.store.device_pool.release(Scratch.EXPERT_LOWBIT_READ, self.store.lowbit_read_bytes)
        self.waiting = collections.deque(item for item in self.waiting if item[0] != key)  # read at its use
        self._start_next()

    def settle(self) -> None:
        """At the end of a layer: reads no use took (a use deferred late, or a fault) are settled."""
        self.waiting.clear()
        if self.in_flight:
            self.store.drop_lowbit_reads()
            num_bytes = len(self.in_flight) * self.store.lowbit_read_bytes
            self.store.device_pool.release(Scratch.EXPERT_LOWBIT_READ, num_bytes)
            self.in_flight.clear()

    def _start_next(self) -> None:
        """Start waiting reads while the window and the free room allow."""
        store, pool, num_bytes = self.store, self.store.device_pool, self.store.lowbit_read_bytes
        while self.waiting and len(self.in_flight) < self.window and pool.can_reserve(num_bytes):
            key, request_ids = self.waiting.popleft()
            with io_context(request_ids, IOPriority.EXPERT_MISS, f"{key[0]}:{key[1]}"):
                if store.start_lowbit_read(key):
                    pool.reserve(Scratch.EXPERT_LOWBIT_READ, num_bytes)
                    self.in_flight.add(key)

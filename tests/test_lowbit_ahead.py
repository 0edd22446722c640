"""`LowbitReadAhead`: a layer's persisted low-bit copies are read ahead at most a window at a time, each buffer
counted in the RAM budget until its use takes it; a later read starts only in free room; reads no use took are
settled at the layer's end and their room given back."""

from __future__ import annotations

from fallbackgate.engine.device_pool import Scratch, TierPool
from fallbackgate.engine.experts.lowbit_ahead import LowbitReadAhead

READ_BYTES = 100


class FakeStore:
    """The store's read-ahead surface: which copies are persisted, which reads were queued and dropped."""

    def __init__(self, budget_bytes: int, persisted: set) -> None:
        self.device_pool = TierPool("ram", budget_bytes)
        self.lowbit_read_bytes = READ_BYTES
        self.persisted, self.started, self.num_dropped = persisted, [], 0

    def is_lowbit_read_from_disk(self, key) -> bool:
        return key in self.persisted

    def start_lowbit_read(self, key) -> bool:
        self.started.append(key)
        return True

    def drop_lowbit_reads(self) -> int:
        self.num_dropped += 1
        return 0


def _held(store: FakeStore) -> int:
    return store.device_pool.used_bytes_by_kind[Scratch.EXPERT_LOWBIT_READ]


def test_reads_start_a_window_at_a_time_and_each_use_frees_room_for_the_next() -> None:
    keys = {(3, e): ("r1",) for e in range(5)}
    store = FakeStore(budget_bytes=1000, persisted={(3, 0), (3, 1), (3, 2), (3, 4)})  # (3, 3) is kept in RAM
    ahead = LowbitReadAhead(store, window=2)  # type: ignore[arg-type]
    asked = []
    ahead.start(keys, asked.append)
    assert asked == [2 * READ_BYTES]  # room for the first window, in the victim order
    assert store.started == [(3, 0), (3, 1)] and _held(store) == 2 * READ_BYTES
    ahead.took((3, 0))
    assert store.started == [(3, 0), (3, 1), (3, 2)] and _held(store) == 2 * READ_BYTES
    ahead.took((3, 3))  # a kept copy: nothing was read for it, nothing to release
    assert _held(store) == 2 * READ_BYTES
    ahead.took((3, 1))
    ahead.took((3, 2))
    assert store.started == [(3, 0), (3, 1), (3, 2), (3, 4)] and _held(store) == READ_BYTES
    ahead.settle()  # (3, 4)'s use never came (deferred late): its read is dropped and its room given back
    assert _held(store) == 0 and store.num_dropped == 1 and not ahead.in_flight and not ahead.waiting


def test_a_later_read_starts_only_in_free_room_and_a_taken_key_is_read_at_its_use() -> None:
    keys = {(0, e): ("r1", "r2") for e in range(3)}
    store = FakeStore(budget_bytes=READ_BYTES + 50, persisted=set(keys))
    ahead = LowbitReadAhead(store, window=2)  # type: ignore[arg-type]
    ahead.start(keys, lambda num_bytes: None)  # the victim order freed nothing more
    assert store.started == [(0, 0)] and _held(store) == READ_BYTES  # one buffer fits, not two
    ahead.took((0, 2))  # used before its read could start: read at its use, taken off the queue
    assert store.started == [(0, 0)] and [k for k, _ in ahead.waiting] == [(0, 1)]
    ahead.took((0, 0))
    assert store.started == [(0, 0), (0, 1)] and _held(store) == READ_BYTES
    ahead.settle()
    assert _held(store) == 0


def test_nothing_persisted_asks_for_no_room_and_settles_nothing() -> None:
    store = FakeStore(budget_bytes=1000, persisted=set())
    ahead = LowbitReadAhead(store)  # type: ignore[arg-type]
    asked = []
    ahead.start({(1, 1): ("r",)}, asked.append)
    ahead.settle()
    assert asked == [] and store.started == [] and store.num_dropped == 0 and _held(store) == 0

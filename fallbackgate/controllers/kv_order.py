"""`Recency.kv_lru_first`'s order kept incrementally for views with a KV residency journal.

The order is a function of the device blocks, the running requests, the request order
(``view.kv_request_ids``) and the recency of reads. Between two recency updates (step ends), while the running
set and the request order stay the same, a block coming on device or going off it moves no other block, so
each group (idle requests, then running ones) keeps two sorted lists — never-read blocks by (index, layer,
request position), read blocks by when they were last read — patched from ``view.kv_changes_since``
instead of re-walking every request's blocks for every victim taken. Anything else rebuilds them once.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Iterator, Mapping
from typing import Any

from fallbackgate.engine.controller import ControllerView
from fallbackgate.engine.kv.store import KVBlockKey

_KEY = operator.itemgetter(1)  # (sort key, block key) -> block key
SortKey = tuple[int, int, int]  # never read: (index, layer, request position); read: (rank, 0, 0)


class KVOrder:
    """The device KV blocks in `kv_lru_first` order, patched from one view's residency journal."""

    def __init__(self) -> None:
        self.view: Any = None
        self.cursor = -1
        self.running: tuple[str, ...] = ()
        self.request_ids: tuple[str, ...] = ()
        self.position: dict[str, int] = {}
        self.lists: tuple[list, list, list, list] = ([], [], [], [])  # (never, read) of idle, then running
        self.where: dict[KVBlockKey, tuple[int, SortKey]] = {}  # block -> (list, its sort key there)

    def invalidate(self) -> None:
        """Forget the order (recency changed): the next `ordered` rebuilds it."""
        self.view = None

    def ordered(self, view: ControllerView, seen: Mapping[KVBlockKey, int]) -> Iterator[KVBlockKey] | None:
        """The order for `view` (``seen``: every read block's rank), or None when `view` keeps no journal."""
        changes, cursor = view.kv_changes_since(self.cursor if view is self.view else -1)
        if cursor < 0:
            return None
        running, rids = tuple(view.running_ids), view.kv_request_ids
        if changes is None or running != self.running or rids != self.request_ids:
            self._rebuild(view, seen, running, rids)
        else:
            for key, is_on in changes:
                self._patch(key, is_on, seen)
        self.view, self.cursor = view, cursor
        # a copy, so a later call's patches do not move what an unfinished walk still reads; iterated in C
        return map(_KEY, itertools.chain.from_iterable([list(items) for items in self.lists]))

    def _rebuild(self, view: ControllerView, seen: Mapping, running: tuple[str, ...], rids: tuple[str, ...]) -> None:
        self.running, self.request_ids = running, rids
        self.position = {rid: i for i, rid in enumerate(rids)}
        self.lists, self.where = ([], [], [], []), {}
        for rid in rids:
            for block in view.device_kv_blocks_of(rid, is_index_major=True):
                self._place(block.key, seen, is_sorted=False)
        for items in self.lists:
            items.sort()

    def _patch(self, key: KVBlockKey, is_on: bool, seen: Mapping) -> None:
        if not is_on:
            found = self.where.pop(key, None)
            if found is not None:
                items = self.lists[found[0]]
                del items[bisect.bisect_left(items, (found[1], key))]
        elif key not in self.where:
            self._place(key, seen, is_sorted=True)

    def _place(self, key: KVBlockKey, seen: Mapping, is_sorted: bool) -> None:
        rank = seen.get(key)
        # a request missing from the (unchanged) request order came and went between two calls: any position
        position = self.position.get(key[0], len(self.position))
        sort_key = (key[2], key[1], position) if rank is None else (rank, 0, 0)
        which = 2 * (key[0] in self.running) + (rank is not None)
        self.where[key] = (which, sort_key)
        if is_sorted:
            bisect.insort(self.lists[which], (sort_key, key))
        else:
            self.lists[which].append((sort_key, key))

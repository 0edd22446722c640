"""Kept prefix blocks in a simulation, as the engine's prefix reuse keeps them (``engine/kv/prefix_cache.py``).

When a request ends, its full blocks (those with a content hash in the trace) stay in the budget as kept
entries — one pseudo request per block position, ``PREFIX_ID`` + the hash, its layers' blocks at index 0 — until
a controller takes them off device like any KV block. A block computed at or after a step where the request was
served anything not exact is not kept (the engine's taint). An entry with a layer left without an exact copy (a
controller dropped it) is forgotten whole when a request ends, or when a request would adopt it. A later request
whose first read of a block names a kept hash adopts the whole entry at once, every layer's block (and its
off-device copies) becoming the request's, read where it is (a device hit, else a miss served from its copy).
What the controllers see is the engine's :class:`PrefixEntryInfo`: adoptions so far, idle steps, layers on
device, the run's reuse share and whether it belongs to a session.

Simplified against the engine: adoption happens at a request's first read of the block (the engine adopts a
request's matching chain at admission, and shares blocks every layer of which is on device instead of moving
them); blocks published while their request still runs are not modelled, nor are the caps on kept bytes (256 MiB
on the fast tier, 1 GiB off it by default); a trace does not record sessions, so a block counts as a session's
when a later request of the trace reads its hash (what a declared session promises the engine).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from fallbackgate.engine.kv.prefix_types import PREFIX_ID, PrefixEntryInfo
from fallbackgate.engine.tags import Tier

KVKey = tuple[str, int, int]


class SimulatedView(Protocol):
    """What the kept blocks need of the simulated view: its blocks' copies and the two ways to change them."""

    kv: dict[KVKey, tuple[Any, ...]]  # block -> (exact tier, quantized tier, bits); exact None: no exact copy

    def set_kv(self, key: KVKey, copies: tuple[Any, ...]) -> None: ...

    def drop_kv(self, key: KVKey) -> None: ...


@dataclasses.dataclass(slots=True)
class _Entry:
    pid: str  # pseudo request id of the kept block position (PREFIX_ID + the trace's 64-bit hash in hex)
    num_hits: int  # adoptions of this content so far
    last_step: int  # step index when it was kept or last adopted
    is_session: bool  # a later request of the trace reads it


class KeptPrefixes:
    """The kept entries of one simulation and the run's reuse counts."""

    def __init__(self, num_layers: int, last_read: dict[int, int]) -> None:
        """``last_read``: per content hash, the last step index at which the trace reads it."""
        self.num_layers, self.last_read = num_layers, last_read
        self.entries: dict[int, _Entry] = {}  # content hash -> kept entry
        self.by_pid: dict[str, int] = {}  # pseudo id -> content hash
        self.block_hashes: dict[tuple[str, int], int] = {}  # (request, block) -> content hash of its block
        self.hits: dict[tuple[str, int], int] = {}  # (request, block) -> adoptions of the content it adopted
        self.tainted: dict[str, int] = {}  # request -> first block computed at or after a non-exact serve
        self.num_kept = 0  # block positions kept so far
        self.num_reused = 0  # block positions adopted so far

    def note(self, key: KVKey, content_hash: int) -> None:
        """Remember the content hash a request's block was read with (0: none, a partial block)."""
        if content_hash:
            self.block_hashes[(key[0], key[2])] = content_hash

    def taint(self, request_id: str, block: int) -> None:
        """The request was served something not exact while computing `block`: it and later blocks stay unkept."""
        self.tainted[request_id] = min(self.tainted.get(request_id, block), block)

    def _keys(self, pid: str) -> list[KVKey]:
        return [(pid, layer, 0) for layer in range(self.num_layers)]

    def _is_intact(self, view: SimulatedView, pid: str) -> bool:
        return all(view.kv.get(k, (None,))[0] is not None for k in self._keys(pid))

    def _forget(self, view: SimulatedView, content_hash: int) -> None:
        """Drop an entry and whatever its layers still hold."""
        entry = self.entries.pop(content_hash)
        del self.by_pid[entry.pid]
        for key in self._keys(entry.pid):
            if key in view.kv:
                view.drop_kv(key)

    def adopt(self, view: SimulatedView, key: KVKey, content_hash: int, step: int) -> bool:
        """At a request's first read of block `key`: take the kept entry of `content_hash`, every layer, into the
        request's blocks; False (nothing moved) when the content is not kept or the entry lost an exact copy."""
        entry = self.entries.get(content_hash) if content_hash else None
        if entry is None:
            return False
        if not self._is_intact(view, entry.pid):
            self._forget(view, content_hash)
            return False
        for kept in self._keys(entry.pid):
            copies = view.kv[kept]
            view.drop_kv(kept)
            view.set_kv((key[0], kept[1], key[2]), copies)
        del self.entries[content_hash], self.by_pid[entry.pid]
        self.hits[(key[0], key[2])] = entry.num_hits + 1
        self.num_reused += 1
        return True

    def prune(self, view: SimulatedView) -> None:
        """Forget the entries with a layer left without an exact copy (the engine's prune at a release)."""
        for content_hash in [h for h, e in self.entries.items() if not self._is_intact(view, e.pid)]:
            self._forget(view, content_hash)

    def keep(self, view: SimulatedView, request_id: str, blocks: dict[int, list[KVKey]], step: int) -> None:
        """At a request's end: move its blocks (per block index, every layer's key) that qualify into kept
        entries — a hash, every layer with an exact copy, untainted, content not kept already."""
        first_tainted = self.tainted.pop(request_id, 1 << 62)
        for index in sorted(blocks):
            content_hash = self.block_hashes.pop((request_id, index), 0)
            num_hits = self.hits.pop((request_id, index), 0)
            keys = blocks[index]
            if not content_hash or index >= first_tainted or content_hash in self.entries:
                continue
            if len(keys) < self.num_layers or any(view.kv[k][0] is None for k in keys):
                continue
            pid = PREFIX_ID + f"{content_hash:016x}"
            is_session = self.last_read.get(content_hash, -1) > step
            self.entries[content_hash] = _Entry(pid, num_hits, step, is_session)
            self.by_pid[pid] = content_hash
            self.num_kept += 1
            for key in keys:
                copies = view.kv[key]
                view.drop_kv(key)
                view.set_kv((pid, key[1], 0), copies)

    def info(self, view: SimulatedView, pid: str, step: int) -> PrefixEntryInfo | None:
        """What the controller sees of the kept entry `pid` (None: not a kept entry)."""
        content_hash = self.by_pid.get(pid)
        if content_hash is None:
            return None
        entry = self.entries[content_hash]
        on_device = sum(view.kv.get(k, (None,))[0] is Tier.DEVICE for k in self._keys(pid))
        share = (1 + self.num_reused) / (1 + self.num_kept)
        return PrefixEntryInfo(
            f"{content_hash:016x}", entry.num_hits, step - entry.last_step, on_device, share, entry.is_session
        )

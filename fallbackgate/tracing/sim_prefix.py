"""Kept prefix blocks in a simulation, as the engine's prefix reuse keeps them (``engine/kv/prefix_cache.py``).

When a request ends, its full blocks (those with a content hash in the trace) stay in the budget as kept
entries — one pseudo request per block position, ``PREFIX_ID`` + the hash, its layers' blocks at index 0 — until
a controller takes them off device like any KV block. A later request whose first access to a block names a kept
hash adopts it: the block (and its off-device copies) becomes the request's, read where it is (a device hit,
else a miss served from its copy); a block left without an exact copy cannot be adopted and is computed anew.
What the controllers see is the engine's :class:`PrefixEntryInfo`: adoptions so far, idle steps, layers on
device, the run's reuse share and whether it belongs to a session.

Simplified against the engine: adoption is decided per block and layer as each is first read (the engine adopts
a request's matching chain at admission, all layers at once, and shares blocks every layer of which is on device
instead of moving them); blocks published while their request still runs are not modelled; a trace does not
record sessions, so a block counts as a session's when a later request of the trace reads its hash (what a
declared session promises the engine).
"""

from __future__ import annotations

import dataclasses

from fallbackgate.engine.kv.prefix_types import PREFIX_ID, PrefixEntryInfo
from fallbackgate.engine.tags import Tier

KVKey = tuple[str, int, int]
Copies = tuple[Tier | None, Tier | None, int]  # (exact tier, quantized tier, bits), as SimulatedView.kv


@dataclasses.dataclass(slots=True)
class _Entry:
    pid: str  # pseudo request id of the kept block position
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
        self.num_kept = 0  # block positions kept so far
        self.num_reused = 0  # block positions adopted so far

    def note(self, key: KVKey, content_hash: int) -> None:
        """Remember the content hash a request's block was read with (0: none, a partial block)."""
        if content_hash:
            self.block_hashes[(key[0], key[2])] = content_hash

    def adopt(self, key: KVKey, content_hash: int, kv: dict[KVKey, Copies], step: int) -> KVKey | None:
        """The kept block `key` (a first read) adopts, or None: its content is not kept, or has no exact copy."""
        entry = self.entries.get(content_hash) if content_hash else None
        if entry is None:
            return None
        kept = (entry.pid, key[1], 0)
        copies = kv.get(kept)
        if copies is None or copies[0] is None:
            return None
        if (key[0], key[2]) not in self.hits:
            self.num_reused += 1
            self.hits[(key[0], key[2])] = entry.num_hits + 1
        entry.last_step = step
        return kept

    def release(self, pid: str, kv: dict[KVKey, Copies]) -> None:
        """Forget an entry none of whose layers is left (all adopted)."""
        content_hash = self.by_pid.get(pid)
        if content_hash is not None and not any((pid, layer, 0) in kv for layer in range(self.num_layers)):
            del self.by_pid[pid]
            self.entries.pop(content_hash, None)

    def keep(
        self, request_id: str, blocks: dict[int, list[KVKey]], kv: dict[KVKey, Copies], step: int
    ) -> list[tuple[KVKey, KVKey]]:
        """At a request's end: which of its blocks (per block index, every layer's key) become kept entries,
        as (key, pseudo key) moves; a block position is kept when it has a hash, every layer an exact copy and
        its content is not kept already."""
        moves = []
        for index in sorted(blocks):
            content_hash = self.block_hashes.pop((request_id, index), 0)
            keys = blocks[index]
            if not content_hash or len(keys) < self.num_layers or any(kv[k][0] is None for k in keys):
                continue
            if content_hash in self.entries:
                continue
            pid = PREFIX_ID + f"{content_hash:016x}"
            is_session = self.last_read.get(content_hash, -1) > step
            self.entries[content_hash] = _Entry(pid, self.hits.pop((request_id, index), 0), step, is_session)
            self.by_pid[pid] = content_hash
            self.num_kept += 1
            moves += [(k, (pid, k[1], 0)) for k in keys]
        for index in blocks:
            self.hits.pop((request_id, index), None)
        return moves

    def info(self, pid: str, device_layers: int, step: int) -> PrefixEntryInfo | None:
        """What the controller sees of the kept entry `pid` (None: not a kept entry)."""
        content_hash = self.by_pid.get(pid)
        entry = self.entries.get(content_hash) if content_hash is not None else None
        if entry is None:
            return None
        share = (1 + self.num_reused) / (1 + self.num_kept)
        return PrefixEntryInfo(
            f"{content_hash:016x}", entry.num_hits, step - entry.last_step, device_layers, share, entry.is_session
        )

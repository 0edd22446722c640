"""Prefix blocks shared by live requests: a request's full exact block becomes adoptable by hash once its
prefill is done (`share_computed`); the first request that adopts it while its request still runs moves it into
a one-block table of its own that both read through aliases (one device slot, counted once; reference-counted
by `KVStore.holders`). A held block stays in the fast tier and is never written (full blocks are append-only);
when one holder is left it takes the block back as its own, when none is it is a kept entry like any other.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable

from fallbackgate.engine.kv.block import KVBlock
from fallbackgate.engine.kv.prefix_types import KeptEntry, PrefixStats
from fallbackgate.engine.kv.store import KVStore
from fallbackgate.engine.sequence import Sequence


class PrefixSharing:
    """The sharing half of :class:`~fallbackgate.engine.kv.prefix_cache.PrefixCache`."""

    kv: KVStore
    is_enabled: bool
    step_of: Callable[[], int]
    entries: collections.OrderedDict[bytes, KeptEntry]
    by_id: dict[str, bytes]
    clean_tokens: dict[str, int]
    next_shared: dict[str, int]  # live request -> its first block index not yet looked at to share
    computed: dict[bytes, str]  # content hash -> the live request whose own full exact block has it
    computed_by: dict[str, list[bytes]]  # live request -> the hashes it put in `computed`
    stats: PrefixStats
    hashes: Callable[[Sequence, int], list[bytes]]
    _keep: Callable[..., None]  # PrefixCache._keep(digest, blocks, num_hits, holder=None): keep as an entry
    _move: Callable[[KVBlock, str, int], None]  # PrefixCache._move(block, request_id, index): into a table

    def _share(self, entry: KeptEntry, request_id: str, index: int) -> bool:
        """Alias an entry whose every layer is in the fast tier at the request's block `index` (a shared
        read, counted once); False (nothing done) when a layer is off it (then it is moved, if nobody holds it)."""
        kv = self.kv
        if not all(t[0].device is not None for t in kv.tables[entry.request_id]):
            return False
        self.stats.num_shared_blocks += bool(kv.holders.get(entry.request_id))
        kv.alias(request_id, index, entry.request_id)
        self.entries.move_to_end(entry.digest)
        entry.num_hits, entry.last_step = entry.num_hits + 1, self.step_of()
        self.stats.num_reused_resident += kv.num_layers
        return True

    def share_computed(self, seqs: Iterable[Sequence]) -> None:
        """Step end: note each running request's full blocks whose prefill is done and that are exact (no
        non-exact event at or before them) as adoptable by hash; a block still being filled is not. One is
        shared when a request adopts it (`_publish`): until then it is its request's own, spilled like any."""
        if not self.is_enabled:
            return
        kv, size = self.kv, self.kv.block_size
        for seq in seqs:
            rid = seq.request_id
            if rid not in kv.tables:
                continue
            num_full = min(kv.num_tokens.get(rid, 0), self.clean_tokens.get(rid, 1 << 62)) // size
            index = self.next_shared.get(rid, 0)
            digests = self.hashes(seq, num_full)
            while index < num_full:
                blocks = [kv.tables[rid][layer][index] for layer in range(kv.num_layers)]
                if any(b.num_tokens != size for b in blocks):
                    break  # not filled yet (a chunked prefill): looked at again next step
                digest = digests[index]
                if blocks[0].key[0] == rid and digest not in self.entries and digest not in self.computed:
                    self.computed[digest] = rid
                    self.computed_by.setdefault(rid, []).append(digest)
                index += 1
            self.next_shared[rid] = index

    def _publish(self, digest: bytes, index: int) -> KeptEntry | None:
        """A live request's own block with this hash, moved into a shared entry its request then reads through
        an alias (None: no such block, or it is no longer exact, full and in the fast tier in every layer)."""
        kv, owner = self.kv, self.computed.get(digest)
        table = kv.tables.get(owner) if owner is not None else None
        if owner is None or table is None or index >= len(table[0]):
            return None
        if (index + 1) * kv.block_size > self.clean_tokens.get(owner, 1 << 62):
            return None
        blocks = [t[index] for t in table]
        if not all(b.key == (owner, layer, index) and b.num_tokens == kv.block_size and b.device is not None
                   for layer, b in enumerate(blocks)):  # fmt: skip
            return None
        del self.computed[digest]
        self._keep(digest, blocks, 0, holder=owner)
        self.stats.num_published_blocks += 1
        return self.entries[digest]

    def _let_go_all(self, request_id: str) -> None:
        for index, owner_id in list(self.kv.aliases.get(request_id, {}).items()):
            self._let_go(request_id, index, owner_id)

    def _let_go(self, request_id: str, index: int, owner_id: str) -> None:
        """`request_id` stops holding the shared block `owner_id` (its block `index`): with one holder left the
        block goes back to that request's own table; with none it is a kept entry (capped, spillable)."""
        kv = self.kv
        holders = kv.holders.get(owner_id, set())
        holders.discard(request_id)
        kv.aliases.get(request_id, {}).pop(index, None)
        digest = self.by_id.get(owner_id)
        if digest is None or digest not in self.entries:
            return
        if len(holders) == 1:
            self._unshare(self.entries[digest], next(iter(holders)), index)
        elif not holders:
            self.entries.move_to_end(digest)
            self.entries[digest].last_step = self.step_of()

    def _unshare(self, entry: KeptEntry, holder: str, index: int) -> None:
        """The last holder takes the shared block back as its own (its copies journalled as moved to it), so it
        may spill it again; it stays adoptable by hash while that request runs."""
        kv = self.kv
        del kv.aliases[holder][index]
        kv.holders.pop(entry.request_id, None)
        for table in kv.tables.pop(entry.request_id):
            self._move(table[0], holder, index)  # the holder's table already has this block object there
        kv.num_tokens.pop(entry.request_id, None)
        kv.off_device.pop(entry.request_id, None)
        self.by_id.pop(entry.request_id, None)
        del self.entries[entry.digest]
        self.computed[entry.digest] = holder
        self.computed_by.setdefault(holder, []).append(entry.digest)

    def _forget_computed(self, request_id: str) -> None:
        for digest in self.computed_by.pop(request_id, []):
            if self.computed.get(digest) == request_id:
                del self.computed[digest]
        self.next_shared.pop(request_id, None)

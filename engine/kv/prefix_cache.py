"""Prefix reuse across requests and turns: full KV blocks content-hashed and kept after their request ends.

A full block's content hash is ``blake2b(parent hash ‖ its block_size token ids)`` (vLLM's automatic prefix
caching: a block's hash names its whole prefix), the same for every layer. When a request ends, its full
blocks that were computed exactly (no event of a non-exact tag at or before their positions) are kept: each
block position's blocks of every layer move, with their full-precision copies, into a one-block table of
their own under the pseudo request id ``prefix:<hash>``, where they stay in the budget beside live requests'
blocks. The controller sees them through the view (``prefix_entry``) and decides, against cold experts,
when they leave RAM (spilled to disk, still reusable) or are dropped. A later request whose prompt starts
with the same blocks adopts them when it is admitted: they move into its table and its prefill starts after
them (at least one prompt token is always computed, for the logits). A block adopted from RAM is read
``resident`` by its steps, after its bytes were checked against the CRC32 taken when it was kept; one on
disk is read ``exact_load`` from the spill (every page's CRC32 checked). Moves of host and disk copies are
journalled (``moved_out`` from the old owner, ``moved_in`` to the new one, in that order), so the audit's
copy replay follows a copy from the request that wrote it to the one that reads it.

Requests that run at the same time share blocks too (`prefix_share.py`): a running request's full exact
block is adoptable once its prefill is done; the adopter and it then read one copy (one device slot) through
aliases, and it stays in RAM while either holds it. An aborted or drop-preempted request's exact full blocks
are kept as on finish.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable

from fallbackgate.engine.kv.block import KVBlock
from fallbackgate.engine.kv.prefix_share import PrefixSharing
from fallbackgate.engine.kv.prefix_types import (
    DEFAULT_RAM_CAP_BYTES,
    DEFAULT_SPILL_CAP_BYTES,
    PREFIX_ID,
    ROOT_DIGEST,
    KeptEntry,
    PrefixEntryInfo,
    PrefixStats,
    block_crc,
    chain_hashes,
    hash_u64,
)
from fallbackgate.engine.kv.store import KVStore
from fallbackgate.engine.messages import CopyAction, Event, StepPlan
from fallbackgate.engine.sequence import Sequence
from fallbackgate.engine.tags import Exactness, ObjectKind, Tag, Tier

__all__ = ["PREFIX_ID", "ROOT_DIGEST", "PrefixCache", "PrefixEntryInfo", "PrefixStats", "chain_hashes", "hash_u64"]


class PrefixCache(PrefixSharing):
    """Kept full KV blocks by content hash, and the requests' hash chains (mechanism: the controller
    decides what leaves RAM)."""

    def __init__(
        self,
        kv: KVStore,
        is_enabled: bool,
        step_of: Callable[[], int],
        spill_cap_bytes: int = DEFAULT_SPILL_CAP_BYTES,
        ram_cap_bytes: int = DEFAULT_RAM_CAP_BYTES,
    ) -> None:
        self.kv, self.is_enabled, self.step_of = kv, is_enabled, step_of
        self.spill_cap_bytes, self.ram_cap_bytes = spill_cap_bytes, ram_cap_bytes
        self.entries: collections.OrderedDict[bytes, KeptEntry] = collections.OrderedDict()  # least recent first
        self.by_id: dict[str, bytes] = {}  # pseudo request id -> digest
        self.chains: dict[str, list[bytes]] = {}  # live request -> hashes of its full blocks so far
        self.chain_ids: dict[str, list[int]] = {}  # live request -> the same hashes as uint64 (the trace's)
        self.clean_tokens: dict[str, int] = {}  # live request -> positions below which its KV is exact
        self.hits: dict[str, list[int]] = {}  # live request -> adopted blocks' hit counts, by block index
        self.next_shared: dict[str, int] = {}  # live request -> its first block index not yet looked at to share
        self.computed: dict[bytes, str] = {}  # content hash -> the live request whose own full exact block has it
        self.computed_by: dict[str, list[bytes]] = {}  # live request -> the hashes it put in `computed`
        self.stats = PrefixStats()

    # --- hashes ----------------------------------------------------------------------------------
    def hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Content hashes of the request's first `num_blocks` full blocks."""
        known = self.chains.setdefault(seq.request_id, [])
        return chain_hashes(seq.all_token_ids, self.kv.block_size, num_blocks, known)

    def read_hashes(self, seq: Sequence, num_tokens: int) -> list[int]:
        """uint64 content hashes of the request's full blocks once its first `num_tokens` positions are
        written (a step's reads; the partial tail has none)."""
        num_blocks = num_tokens // self.kv.block_size
        ids = self.chain_ids.setdefault(seq.request_id, [])
        if len(ids) < num_blocks:  # a block filled since: hash it (once per block)
            ids += [hash_u64(d) for d in self.hashes(seq, num_blocks)[len(ids) :]]
        return ids[:num_blocks]

    def note_events(self, plan: StepPlan, events: Iterable[Event]) -> None:
        """Taint what a step computed with a non-exact tag: a request's KV from the step's start position on
        (and from a rebuilt block's first position) is no longer the exact baseline's and is never kept."""
        for event in events:
            if event.tag.exactness is Exactness.EXACT or event.request_id not in plan.start_positions:
                continue
            position = plan.start_positions[event.request_id]
            if event.object_kind is ObjectKind.KV_BLOCK and event.tag is Tag.RECOMPUTE:
                rebuilt = [i * self.kv.block_size for i in event.object_ids]
                position = min([position, *rebuilt]) if rebuilt else 0
            clean = self.clean_tokens.get(event.request_id, position)
            self.clean_tokens[event.request_id] = min(clean, position)

    # --- adoption --------------------------------------------------------------------------------
    def adopt(self, seq: Sequence) -> int:
        """At first admission: take the kept or live blocks matching the request's prompt (shared when every
        layer of one is in the fast tier, else moved into its table) and skip their prefill; returns the
        tokens skipped."""
        kv, size = self.kv, self.kv.block_size
        if not self.is_enabled or not (self.entries or self.computed) or seq.num_computed_tokens:
            return 0
        if seq.num_recompute_tokens:  # a drop-preempted request rebuilds its own KV (tagged recompute)
            return 0
        if seq.num_scored_tokens or seq.params.num_prompt_logprobs is not None or kv.num_tokens[seq.request_id]:
            return 0  # prompt positions asked for: they must be computed
        max_blocks = (len(seq.prompt_token_ids) - 1) // size
        hits: list[int] = []
        for index, digest in enumerate(self.hashes(seq, max_blocks)):
            entry = self.entries.get(digest) or self._publish(digest, index)
            if entry is None or not self._is_intact(entry):
                break
            if self._share(entry, seq.request_id, index):
                hits.append(entry.num_hits)
            elif kv.holders.get(entry.request_id):
                break  # cannot happen: a held block stays in the fast tier
            else:
                del self.entries[digest]
                self._move_entry(entry, seq.request_id, index)
                hits.append(entry.num_hits + 1)
        if hits:
            num = len(hits) * size
            kv.num_tokens[seq.request_id] = seq.num_computed_tokens = seq.num_reused_tokens = num
            self.hits[seq.request_id] = hits
            self.stats.num_reused_blocks += len(hits)
            self.stats.num_reused_tokens += num
            self.stats.num_reused_requests += 1
        return len(hits) * size

    def _is_intact(self, entry: KeptEntry) -> bool:
        """Every layer's block still has a full-precision copy, and those in the fast tier the bytes they
        had when kept; an entry that fails is dropped."""
        blocks = [table[0] for table in self.kv.tables[entry.request_id]]
        is_held = bool(self.kv.holders.get(entry.request_id))  # in use: not dropped, only not shared further
        if not all(b.has_exact_copy for b in blocks):
            if not is_held:
                self._drop(entry)
            return False
        for block, crc in zip(blocks, entry.crcs, strict=True):
            if block.device is not None and crc is not None and block_crc(block) != crc:
                self.stats.num_checksum_failures += 1
                if not is_held:
                    self._drop(entry)
                return False
        return True

    def _move_entry(self, entry: KeptEntry, request_id: str, index: int) -> None:
        kv = self.kv
        for layer, table in enumerate(kv.tables.pop(entry.request_id)):
            block = table[0]
            self._move(block, request_id, index)
            kv.tables[request_id][layer].append(block)
            if block.device is not None:
                self.stats.num_reused_resident += 1
            else:
                self.stats.num_reused_spilled += 1
        kv.num_tokens.pop(entry.request_id, None)
        kv.off_device.pop(entry.request_id, None)
        self.by_id.pop(entry.request_id, None)

    def _move(self, block: KVBlock, request_id: str, index: int) -> None:
        """Give `block` (with its copies) to another owner's table position, journalling its off-device
        copies as moved out of the old owner and into the new one."""
        kv = self.kv
        old_id, layer, old_index = block.key
        copies = [tier for tier, copy in ((Tier.HOST, block.host), (Tier.DISK, block.disk)) if copy is not None]
        for tier in copies:
            kv.note_copy(CopyAction.MOVED_OUT, block, tier, 0)
        if old_id in kv.off_device:
            kv.off_device[old_id].discard((layer, old_index))
        block.key = (request_id, layer, index)
        if block.device is None:
            kv.off_device[request_id].add((layer, index))
        for tier in copies:
            kv.note_copy(CopyAction.MOVED_IN, block, tier, 0)

    # --- keeping ---------------------------------------------------------------------------------
    def release(self, seq: Sequence, is_aborted: bool = False, is_kept: bool = True) -> None:
        """A request ended (finished, aborted): it lets go of the blocks it shares; its own exact full blocks
        are kept unless `is_kept` is False (each position not kept already), the rest freed."""
        if is_kept:
            self.keep_blocks(seq, is_aborted)
        else:
            self._let_go_all(seq.request_id)
        self.kv.free_sequence(seq.request_id)
        self.forget(seq.request_id)
        self._prune()

    def keep_blocks(self, seq: Sequence, is_aborted: bool = False) -> None:
        """Keep the request's own exact full blocks as entries nobody holds yet (on finish, abort, or before a
        drop-preemption frees its KV); the shared ones it held lose a holder (the caller frees its table)."""
        kv, rid = self.kv, seq.request_id
        if not self.is_enabled or rid not in kv.tables:
            return
        size = kv.block_size
        num_full = min(kv.num_tokens.get(rid, 0), self.clean_tokens.get(rid, 1 << 62)) // size
        hits = self.hits.get(rid, [])
        self._let_go_all(rid)
        self._forget_computed(rid)
        for index, digest in enumerate(self.hashes(seq, num_full)):
            blocks = [kv.tables[rid][layer][index] for layer in range(kv.num_layers)]
            if blocks[0].key[0] != rid:
                continue  # another table's block (it was shared)
            if not all(b.num_tokens == size and b.has_exact_copy for b in blocks):
                break
            if digest not in self.entries:
                self._keep(
                    digest, blocks, hits[index] if index < len(hits) else 0, is_session=seq.session_id is not None
                )
                self.stats.num_kept_on_abort += is_aborted

    def _keep(
        self, digest: bytes, blocks: list[KVBlock], num_hits: int, holder: str | None = None, is_session: bool = False
    ) -> None:
        """Move `blocks` (one block position, every layer) into a one-block table of their own; `holder`: the
        live request they came from keeps reading them there (an alias), else its table keeps empty places."""
        kv = self.kv
        pid = PREFIX_ID + digest.hex()
        kv.add_sequence(pid)
        owner, _, index = blocks[0].key
        for layer, block in enumerate(blocks):
            kv.tables[owner][layer][index] = KVBlock(block.key)  # the owner's table keeps an empty place
            kv.drop_quant_copies(block)
            self._move(block, pid, 0)
            kv.tables[pid][layer].append(block)
        kv.num_tokens[pid] = kv.block_size
        if holder is not None:
            kv.alias(holder, index, pid)
        crcs = [block_crc(b) if b.device is not None else None for b in blocks]
        self.entries[digest] = KeptEntry(pid, digest, crcs, self.step_of(), num_hits, is_session)
        self.by_id[pid] = digest
        self.stats.num_kept_blocks += 1

    def forget(self, request_id: str) -> None:
        """Drop what is kept about a live request (it ended or its KV was freed)."""
        self.chains.pop(request_id, None)
        self.chain_ids.pop(request_id, None)
        self.clean_tokens.pop(request_id, None)
        self.hits.pop(request_id, None)
        self._forget_computed(request_id)

    def _drop(self, entry: KeptEntry) -> None:
        self.entries.pop(entry.digest, None)
        self.by_id.pop(entry.request_id, None)
        self.kv.free_sequence(entry.request_id)
        self.stats.num_dropped_blocks += 1

    def _prune(self) -> None:
        """Drop entries with a layer left without a full-precision copy (the controller dropped it), then the
        least recently used ones while kept blocks off the fast tier exceed the spill cap or those on it the
        RAM cap (a server's kept prefixes stay within a stated bound, not the whole budget)."""
        kv = self.kv
        idle = [e for e in self.entries.values() if not kv.holders.get(e.request_id)]  # held ones are in use
        dead = [e for e in idle if not all(t[0].has_exact_copy for t in kv.tables[e.request_id])]
        for entry in dead:
            self._drop(entry)
        idle = [e for e in idle if e.digest in self.entries]
        off = {e.digest: sum(t[0].device is None for t in kv.tables[e.request_id]) for e in idle}
        total = sum(off.values()) * kv.bytes_per_block
        for entry in idle:
            if total <= self.spill_cap_bytes:
                break
            if off[entry.digest]:
                total -= off[entry.digest] * kv.bytes_per_block
                self._drop(entry)
        idle = [e for e in idle if e.digest in self.entries]
        on = {e.digest: len(kv.tables[e.request_id]) - off[e.digest] for e in idle}
        total = sum(on.values()) * kv.bytes_per_block
        for entry in idle:
            if total <= self.ram_cap_bytes:
                break
            if on[entry.digest]:
                total -= on[entry.digest] * kv.bytes_per_block
                self._drop(entry)

    # --- the controller's view -------------------------------------------------------------------
    def entry_info(self, request_id: str) -> PrefixEntryInfo | None:
        """The kept prefix block behind pseudo request `request_id`, None for any other id."""
        digest = self.by_id.get(request_id)
        entry = self.entries.get(digest) if digest is not None else None
        if entry is None:
            return None
        on_device = sum(1 for t in self.kv.tables[request_id] if t[0].device is not None)
        share = (1 + self.stats.num_reused_blocks) / (1 + self.stats.num_kept_blocks)
        idle = self.step_of() - entry.last_step
        return PrefixEntryInfo(digest.hex(), entry.num_hits, idle, on_device, share, entry.is_session)

    def summary(self) -> dict[str, int]:
        """Stats plus what is kept now."""
        kv = self.kv
        kept = [t[0] for e in self.entries.values() for t in kv.tables[e.request_id]]
        return {
            "is_enabled": int(self.is_enabled),
            **self.stats.as_dict(),
            "num_kept_now": len(self.entries),
            "num_kept_layer_blocks_on_device": sum(1 for b in kept if b.device is not None),
            "num_kept_layer_blocks_spilled": sum(1 for b in kept if b.device is None),
        }

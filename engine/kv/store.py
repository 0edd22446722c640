"""Paged, tiered KV store: per-request block tables of fixed-size blocks (block_size tokens × one layer).

A block's copies may live on device (full precision), on host (full and/or int8/int4 quantized,
keys per channel and values per token as in KIVI) and on disk (same choices). Full-precision device and
host copies are slots of one pooled tensor per layer per tier (`slots.py`); a block's slot index is its
block-table entry, and a request's device blocks of a layer are gathered with one index. Blocks needed by
a step that are not on device are staged into per-step scratch (exact_load, kv_dequant) or rebuilt
(recompute), or, when the step's KV does not fit at once, read layer by layer (`layer_read.py`).
Every device byte is counted in the device pool: blocks as KV_BLOCK, staged blocks (and a dequantization's
working set while it runs) as Scratch.KV_STAGED. Mechanism only: callers decide what to spill, where, and
how to bring it back, and make room before staging.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from fallbackgate.engine.device_pool import Scratch, TierPool
from fallbackgate.engine.errors import EngineError
from fallbackgate.engine.kv.block import KVBlock, KVBlockKey, RequestBlockKeys, SpillMode, Staged
from fallbackgate.engine.kv.copies import KVCopies
from fallbackgate.engine.kv.spill import PendingRead, SpillDir
from fallbackgate.engine.kv.staging import KVStaging
from fallbackgate.engine.tags import ObjectKind, Tag

__all__ = ["KVBlock", "KVBlockKey", "KVStore", "SpillMode", "Staged"]


class KVStore(KVCopies, KVStaging):
    """Block tables for all live requests; byte-accurate device and host accounting."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        key_dim: int,
        value_dim: int,
        block_size: int,
        device_pool: TierPool,
        host_pool: TierPool | None,
        spill: SpillDir,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        """`host_pool` None (or a zero budget): no host tier; full copies that leave the device go to disk."""
        self.num_layers, self.num_kv_heads, self.block_size = num_layers, num_kv_heads, block_size
        self.dtype = dtype  # the model's: K and V are stored as attention produced them
        self.key_dim, self.value_dim = key_dim, value_dim
        self.host_pool = host_pool if host_pool is not None else TierPool("host", 0)
        self.device_pool, self.spill, self.device = device_pool, spill, device
        self.block_shape = (num_kv_heads, block_size, key_dim + value_dim)  # K and V side by side per token
        self.bytes_per_block = num_kv_heads * block_size * (key_dim + value_dim) * dtype.itemsize
        self.expand_bytes_per_token = 0  # MLA: bytes one cached position expands to for attention (set by the engine)
        self.device_slots = self._slot_tier("device", device_pool, device)
        self.host_slots = self._slot_tier("host", self.host_pool, torch.device("cpu"))
        self.tables: dict[str, list[list[KVBlock]]] = {}  # request -> layer -> blocks
        self.off_device: dict[str, set[tuple[int, int]]] = {}  # request -> (layer, index) of its off-device blocks
        self.num_tokens: dict[str, int] = {}
        self.aliases: dict[str, dict[int, str]] = {}  # request -> block index -> shared table it reads there
        self.holders: dict[str, set[str]] = {}  # shared table (a prefix block's) -> live requests aliasing it
        self.scratch: dict[KVBlockKey, Staged] = {}
        self.pending_exact: dict[KVBlockKey, PendingRead] = {}  # disk reads queued ahead of their staging
        self.copy_changes, self.num_copy_changes = [], 0  # the copy journal (`KVCopies.note_copy`)
        self.write_behind_pool, self.num_behind_bytes = self.host_pool, 0  # RAM's budget (the engine sets it)

    # --- block tables --------------------------------------------------------------------------
    def close(self) -> None:
        """Finish the writes in flight and remove the spill directory (the store serves no more). A write
        that failed after the last step is not reported: what it wrote goes with the directory."""
        try:
            with contextlib.suppress(EngineError):
                self.finish_writes()
        finally:
            self.spill.close()

    def add_sequence(self, request_id: str) -> None:
        self.tables[request_id] = [[] for _ in range(self.num_layers)]
        self.off_device[request_id] = set()
        self.num_tokens[request_id] = 0

    def free_sequence(self, request_id: str) -> None:
        """Release every copy of every block of a request; a block it shares (an alias of another table's
        block) is only let go: its holder count drops, its copies stay with the table that owns it."""
        for pid in self.aliases.pop(request_id, {}).values():
            self.holders.get(pid, set()).discard(request_id)
        for blocks in self.tables.pop(request_id, []):
            for block in blocks:
                if block.key[0] == request_id:
                    self._drop_copies(block, keep_device=False)
        self.num_tokens.pop(request_id, None)
        self.off_device.pop(request_id, None)
        for key in [k for k in self.scratch if k[0] == request_id]:
            self._drop_scratch(key)

    def blocks(self, request_id: str, layer: int) -> list[KVBlock]:
        return self.tables[request_id][layer]

    # --- shared blocks (prefix reuse by concurrent requests) -----------------------------------
    def alias(self, request_id: str, index: int, owner_id: str) -> None:
        """Let `request_id` read `owner_id`'s one-block table at its block `index` (every layer): the same
        block objects, one device slot each, counted once in the pool; the owner's blocks are never spilled
        while a request holds them, and no holder writes them (full blocks are append-only)."""
        for layer, blocks in enumerate(self.tables[request_id]):
            block = self.tables[owner_id][layer][0]
            if index < len(blocks):
                blocks[index] = block
            else:
                blocks.append(block)
        self.aliases.setdefault(request_id, {})[index] = owner_id
        self.holders.setdefault(owner_id, set()).add(request_id)

    def is_held(self, key: KVBlockKey) -> bool:
        """Whether the block `key` names is shared by a live request (then it stays in the fast tier)."""
        return bool(self.holders.get(key[0]))

    def block_keys(self, request_ids: list[str]) -> RequestBlockKeys:
        """Every block of every layer of these requests (those without a table have none), as a set-like
        container built in O(len(request_ids))."""
        return RequestBlockKeys(frozenset(rid for rid in request_ids if rid in self.tables))

    def device_blocks(self) -> list[KVBlock]:
        """Every device block that may be spilled, once (aliases and held shared blocks left out)."""
        return [b for rid in self.tables for b in self.device_blocks_of(rid)]

    def device_blocks_of(self, request_id: str, is_index_major: bool = False) -> Iterator[KVBlock]:
        """The request's device blocks in `device_blocks` order (layer, then index; `is_index_major`: index,
        then layer), walked lazily: a caller that stops after k blocks walks about k blocks (those off device
        are skipped as met)."""
        table = self.tables.get(request_id, [])
        if self.holders.get(request_id):
            return  # a shared block in use stays where it is
        if not is_index_major:  # an alias (another table's block) is listed by its owner only
            yield from (b for blocks in table for b in blocks if b.device is not None and b.key[0] == request_id)
            return
        for index in range(max((len(blocks) for blocks in table), default=0)):
            for blocks in table:
                if index < len(blocks) and blocks[index].device is not None and blocks[index].key[0] == request_id:
                    yield blocks[index]

    def off_device_blocks(self, request_id: str, num_blocks: int) -> list[KVBlock]:
        """The request's off-device blocks with index below `num_blocks`, by layer then index, from the
        maintained index: O(m log m) for its m off-device blocks, whatever its length."""
        table = self.tables.get(request_id)
        if table is None:
            return []
        places = sorted(p for p in self.off_device[request_id] if p[1] < num_blocks)
        return [table[layer][index] for layer, index in places]

    def bytes_to_append(self, request_id: str, num_new_tokens: int) -> int:
        """Device bytes needed to append `num_new_tokens` (new blocks plus an off-device partial tail)."""
        used = self.num_tokens[request_id]
        num_blocks = -(-(used + num_new_tokens) // self.block_size)
        first_written = used // self.block_size
        num_needed = 0
        for layer_blocks in self.tables[request_id]:
            for index in range(first_written, num_blocks):
                if index >= len(layer_blocks) or layer_blocks[index].device is None:
                    num_needed += 1
        return num_needed * self.bytes_per_block

    def bytes_to_stage(self, request_id: str, num_read_tokens: int) -> int:
        """Scratch bytes to stage the off-device full blocks among the first `num_read_tokens` positions."""
        num_full = num_read_tokens // self.block_size
        num_off = sum(1 for blocks in self.tables.get(request_id, []) for b in blocks[:num_full] if b.device is None)
        return num_off * self.bytes_per_block

    def gather_bytes(self, lengths: list[int]) -> int:
        """Scratch bytes of one layer's `gather` for requests reading `lengths` positions (a request whose
        positions fit one block reads the block itself; longer ones get their blocks concatenated)."""
        num_bytes = 0
        for length in lengths:
            num_blocks = -(-length // self.block_size)
            num_bytes += num_blocks * self.bytes_per_block if num_blocks > 1 else 0
        return num_bytes

    def attend_bytes(self, lengths: list[int]) -> int:
        """Scratch bytes one layer's attention holds for requests reading `lengths` positions: the gather,
        and for MLA the longest request's latents expanded to every head (one request at a time)."""
        expanded = max(lengths, default=0) * self.expand_bytes_per_token
        return self.gather_bytes(lengths) + expanded

    @property
    def max_stage_bytes(self) -> int:
        """Device bytes one off-device block's staging takes at its peak, whatever its copy (a dequantization:
        the quantized bytes, at most a block's, the fp32 block they expand to, and the result)."""
        return 2 * self.bytes_per_block + self.bytes_per_block // self.dtype.itemsize * 4

    def can_append(self, request_id: str, num_new_tokens: int) -> bool:
        return self.device_pool.can_reserve(self.bytes_to_append(request_id, num_new_tokens))

    def append(self, request_id: str, num_new_tokens: int) -> list[Staged]:
        """Make device room for the next tokens: new zeroed blocks, and the partial tail brought back."""
        used = self.num_tokens[request_id]
        num_blocks = -(-(used + num_new_tokens) // self.block_size)
        restored: list[Staged] = []
        for layer, layer_blocks in enumerate(self.tables[request_id]):
            for index in range(used // self.block_size, num_blocks):
                if index >= len(layer_blocks):
                    layer_blocks.append(KVBlock((request_id, layer, index)))
                    self.off_device[request_id].add((layer, index))
                block = layer_blocks[index]
                if block.device is None:
                    staged = self._stage_exact(block) if block.num_tokens else None  # loaded into its slot
                    if staged:
                        staged.key = block.key
                    self._reserve_device(block, staged.tensor if staged else None)
                    self._drop_copies(block, keep_device=True)  # new tokens land on device: older copies go stale
                    if staged:
                        restored.append(staged)
        self.num_tokens[request_id] = used + num_new_tokens
        return restored

    # --- reads and writes during a forward -----------------------------------------------------
    def write(self, request_id: str, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write K [kv_heads, n, key_dim] and V [kv_heads, n, value_dim] for positions start.. ."""
        blocks = self.tables[request_id][layer]
        pos, end = start, start + keys.shape[1]
        while pos < end:
            index, offset = divmod(pos, self.block_size)
            take = min(self.block_size - offset, end - pos)
            block = blocks[index]
            staged = self.scratch.get(block.key)
            if staged is not None and staged.tag is Tag.RECOMPUTE and block.device is None:
                target = staged.tensor  # a dropped block being rebuilt
            elif block.device is not None and offset >= block.num_tokens:
                target = block.device  # append-only: new positions of a device block
            else:
                pos += take  # an existing copy already holds these positions
                continue
            target[:, offset : offset + take, : self.key_dim] = keys[:, pos - start : pos - start + take]
            target[:, offset : offset + take, self.key_dim :] = values[:, pos - start : pos - start + take]
            block.num_tokens = max(block.num_tokens, offset + take)
            pos += take

    def gather(self, request_id: str, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K [kv_heads, length, key_dim] and V [kv_heads, length, value_dim], from device or scratch."""
        blocks = self.tables[request_id][layer][: -(-length // self.block_size)]
        if len(blocks) > 1 and self.device_slots is not None and all(b.device_slot is not None for b in blocks):
            heads, block_size, width = self.block_shape  # all on device: one copy by slot index
            out = torch.empty((heads, len(blocks), block_size, width), dtype=self.dtype, device=self.device)
            self.device_slots.gather_into(layer, [b.device_slot for b in blocks], out)
            both = out.view(heads, len(blocks) * block_size, width)[:, :length]
            return both[..., : self.key_dim], both[..., self.key_dim :]
        parts = []
        for block in blocks:
            if block.device is not None:
                parts.append(block.device)
            elif block.key in self.scratch:
                parts.append(self.scratch[block.key].tensor)
            else:
                raise EngineError(f"KV block {block.key} read but neither on device nor staged")
        both = torch.cat(parts, dim=1)[:, :length] if len(parts) > 1 else parts[0][:, :length]
        return both[..., : self.key_dim], both[..., self.key_dim :]

    def num_device_blocks(self, request_id: str, layer: int, length: int) -> int:
        """How many of the blocks holding positions 0..length of the request's layer are on device."""
        return sum(1 for b in self.tables[request_id][layer][: -(-length // self.block_size)] if b.device is not None)

    def held_device_bytes(self) -> dict[str, int]:
        """Bytes of the device tensors this store really holds (blocks and staged scratch), by pool kind."""
        blocks = sum(
            b.device.nbytes for rid, t in self.tables.items() for bs in t for b in bs
            if b.device is not None and b.key[0] == rid
        )  # fmt: skip
        staged = sum(s.tensor.nbytes for s in self.scratch.values())
        return {ObjectKind.KV_BLOCK.value: blocks, Scratch.KV_STAGED.value: staged}

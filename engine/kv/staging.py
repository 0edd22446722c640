"""Staging of off-device KV blocks for one step (the KV fallbacks): an exact load of a full copy from host or
disk, a dequantization of a quantized copy, or zeroed room for a recompute; per-step scratch counted in the
device pool as Scratch.KV_STAGED, and promotion of exactly staged blocks into device slots (the staging half of
:class:`~fallbackgate.engine.kv.store.KVStore`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fallbackgate.engine.device_pool import Scratch, TierPool
from fallbackgate.engine.errors import ChecksumError, EngineError
from fallbackgate.engine.io.context import IOPriority, io_context
from fallbackgate.engine.kv.block import KVBlock, KVBlockKey, Staged
from fallbackgate.engine.kv.codec import dequantize_kv, quant_to, read_quant
from fallbackgate.engine.kv.spill import PendingRead, SpillDir
from fallbackgate.engine.messages import CopyAction
from fallbackgate.engine.tags import Tag, Tier


class KVStaging:
    """Per-step scratch of :class:`~fallbackgate.engine.kv.store.KVStore`: staged blocks and queued exact reads."""

    bytes_per_block: int
    block_shape: tuple[int, int, int]
    dtype: torch.dtype
    device: torch.device
    device_pool: TierPool
    spill: SpillDir
    tables: dict[str, list[list[KVBlock]]]
    scratch: dict[KVBlockKey, Staged]
    pending_exact: dict[KVBlockKey, PendingRead]  # disk reads queued ahead of their staging
    blocks: Callable[[str, int], list[KVBlock]]  # KVStore.blocks(request_id, layer)
    note_copy: Callable[..., None]  # KVCopies.note_copy(action, block, tier, bits, num_bytes=0): the copy journal
    _reserve_device: Callable[[KVBlock, torch.Tensor | None], None]  # KVCopies._reserve_device: a device slot

    def stage(self, block: KVBlock, tag: Tag) -> Staged:
        """Make an off-device block readable for this step with `tag`'s computation.

        The staged block holds `bytes_per_block` of the device pool (Scratch.KV_STAGED) until the step ends
        or it is promoted; the caller makes room first (`stage_bytes`).
        """
        self.device_pool.reserve(Scratch.KV_STAGED, self.bytes_per_block)
        try:
            staged = self._stage_tensor(block, tag)
        except BaseException:
            self.device_pool.release(Scratch.KV_STAGED, self.bytes_per_block)
            raise
        staged.key = block.key
        self.scratch[block.key] = staged
        return staged

    def load(self, block: KVBlock, tag: Tag) -> Staged:
        """Read an off-device block with `tag`'s computation into a fresh device tensor that the caller
        holds for a moment (per-layer staging copies it into a layer buffer and counts its bytes); any
        dequantization's working set is counted while it runs."""
        return self._stage_tensor(block, tag)

    def stage_bytes(self, block: KVBlock, tag: Tag) -> int:
        """Device bytes staging `block` with `tag` needs at its peak (the block, plus a dequantization's
        working set: the quantized bytes on device and the fp32 block they expand to)."""
        if tag is not Tag.KV_DEQUANT:
            return self.bytes_per_block
        quant = block.host_q or block.disk_q
        fp32_bytes = self.bytes_per_block // self.dtype.itemsize * 4
        return self.bytes_per_block + (quant.num_bytes if quant else 0) + fp32_bytes

    def submit_exact(self, block: KVBlock) -> None:
        """Queue the disk read of a block whose only full copy is on disk, so several are in flight at once;
        its staging (:meth:`load`, exact) then waits for it. The caller holds room for the read copy."""
        if block.disk is None or block.host is not None:
            raise EngineError(f"KV block {block.key} has no disk-only full copy to read ahead")
        with io_context((block.key[0],), IOPriority.KV_READ, ":".join(map(str, block.key))):
            self.pending_exact[block.key] = self.spill.submit_read(block.disk)

    def drop_pending(self, key: KVBlockKey) -> None:
        """Wait for a queued read nobody staged (a failed layer read) and drop it."""
        pending = self.pending_exact.pop(key, None)
        if pending is not None and pending.ticket is not None and self.spill.io is not None:
            pending.ticket.done.wait()

    def _stage_tensor(self, block: KVBlock, tag: Tag) -> Staged:
        with io_context((block.key[0],), IOPriority.KV_READ, ":".join(map(str, block.key))):  # disk reads: for
            return self._staged(block, tag)  # the block's request, before the step's expert misses

    def _staged(self, block: KVBlock, tag: Tag) -> Staged:
        if tag is Tag.EXACT_LOAD:
            staged = self._stage_exact(block)
        elif tag is Tag.KV_DEQUANT:
            staged = self._stage_dequant(block)
        elif tag is Tag.RECOMPUTE:
            staged = Staged(torch.zeros(self.block_shape, device=self.device, dtype=self.dtype), Tag.RECOMPUTE, None, 0)
        else:
            raise EngineError(f"{tag.value} is not a KV fallback")
        return staged

    def _stage_exact(self, block: KVBlock) -> Staged:
        if block.host is not None:
            tensor = block.host.to(self.device, copy=True)
            self.note_copy(CopyAction.READ, block, Tier.HOST, 0, self.bytes_per_block)
            return Staged(tensor, Tag.EXACT_LOAD, Tier.HOST, self.bytes_per_block)
        if block.disk is None:
            raise EngineError(f"KV block {block.key} has no full-precision copy to load")
        pending = self.pending_exact.pop(block.key, None)
        try:
            tensor = self.spill.finish_read(pending) if pending is not None else self.spill.read(block.disk)
        except ChecksumError:
            self.spill.delete(block.disk)
            block.disk = None
            self.note_copy(CopyAction.FREED, block, Tier.DISK, 0)
            raise
        self.note_copy(CopyAction.READ, block, Tier.DISK, 0, self.bytes_per_block)
        return Staged(tensor.to(self.device), Tag.EXACT_LOAD, Tier.DISK, self.bytes_per_block)

    def _stage_dequant(self, block: KVBlock) -> Staged:
        if block.host_q is not None:
            quant, tier = block.host_q, Tier.HOST
        elif block.disk_q is not None:
            quant, tier = read_quant(self.spill, block.disk_q), Tier.DISK
        else:
            raise EngineError(f"KV block {block.key} has no quantized copy")
        working = self.stage_bytes(block, Tag.KV_DEQUANT) - self.bytes_per_block
        with self.device_pool.held(Scratch.KV_STAGED, working):  # only quantized bytes cross the link
            tensor = dequantize_kv(quant_to(quant, self.device)).to(self.dtype)
        self.note_copy(CopyAction.READ, block, tier, quant.bits, quant.num_bytes)
        return Staged(tensor, Tag.KV_DEQUANT, tier, quant.num_bytes)

    def promote(self, block: KVBlock) -> bool:
        """Move an exactly staged block into a device slot if it fits; dequantized blocks never are."""
        staged = self.scratch.get(block.key)
        if staged is None or staged.tag is Tag.KV_DEQUANT or block.device is not None:
            return False
        self._drop_scratch(block.key)  # the staged tensor becomes the slot: its bytes change kind
        self._reserve_device(block, staged.tensor)
        return True

    def promote_chosen(self, keys: list[KVBlockKey]) -> None:
        """Step end: move the staged blocks the controller chose (of requests still live) into device slots."""
        for request_id, layer, index in keys:
            if request_id in self.tables and index < len(self.blocks(request_id, layer)):
                self.promote(self.blocks(request_id, layer)[index])

    def clear_scratch(self) -> None:
        """Drop every staged block (the step's scratch)."""
        for key in list(self.scratch):
            self._drop_scratch(key)

    def _drop_scratch(self, key: KVBlockKey) -> None:
        del self.scratch[key]
        self.device_pool.release(Scratch.KV_STAGED, self.bytes_per_block)

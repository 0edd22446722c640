"""Where a KV block's copies live: device and host slots of the pooled tensors, and the copies it leaves
behind on host or disk when it leaves the device (the spilling half of :class:`KVStore`).

Every copy written to host or disk, read to serve a step, or freed is noted in order (`copy_changes`, each
with its ordinal); the engine hands the notes on with each step's result, and the audit checks every
off-device KV event against a copy written earlier in the tier it names and not freed since."""

from __future__ import annotations

import contextlib

import torch

from fallbackgate.engine.device_pool import Scratch, TierPool
from fallbackgate.engine.errors import BudgetError, EngineError
from fallbackgate.engine.io.context import IOPriority, io_context
from fallbackgate.engine.kv.block import BOTH_COPIES, KVBlock, SpillMode
from fallbackgate.engine.kv.codec import quant_checksum, quant_kv_nbytes, quantize_kv, write_quant
from fallbackgate.engine.kv.slots import SlotTier
from fallbackgate.engine.kv.spill import SpillDir
from fallbackgate.engine.messages import CopyAction, KVCopyChange
from fallbackgate.engine.tags import ObjectKind, Tier

INITIAL_SLOTS_PER_LAYER = 64  # device and host slot tensors start this large (or at their budget), then double


class KVCopies:
    """Slots and copies of KV blocks; :class:`KVStore` holds the block tables, :class:`KVStaging` the staging."""

    num_layers: int
    key_dim: int
    bytes_per_block: int
    block_shape: tuple[int, int, int]
    dtype: torch.dtype
    device: torch.device
    device_pool: TierPool
    host_pool: TierPool
    spill: SpillDir
    device_slots: SlotTier | None
    host_slots: SlotTier | None
    tables: dict[str, list[list[KVBlock]]]
    off_device: dict[str, set[tuple[int, int]]]  # request -> (layer, index) of its off-device blocks
    copy_changes: list[KVCopyChange]  # copies written, read and freed since the last `take_copy_changes`
    write_behind_pool: TierPool  # the budget of the RAM that disk writes in flight hold their bytes in
    num_behind_bytes: int  # bytes charged there for spill writes not yet waited for
    num_copy_changes: int  # changes noted so far (the next one's ordinal)

    # --- the copy journal ------------------------------------------------------------------------
    def note_copy(
        self, action: CopyAction, block: KVBlock, tier: Tier, bits: int, num_bytes: int = 0, checksum: int | None = None
    ) -> None:
        """Note one change to `block`'s copy in `tier` at `bits` (0: full precision), after it happened;
        joined to the latest note when that is of the same kind, request, layer, tier and precision.
        `checksum`: the codes' checksum of a quantized copy written."""
        request_id, layer, index = block.key
        last = self.copy_changes[-1] if self.copy_changes else None
        if last is not None and (last.request_id, last.layer, last.action, last.tier, last.bits) == (
            request_id, layer, action, tier, bits
        ):  # fmt: skip
            last.block_ids.append(index)
            last.num_bytes += num_bytes
            if checksum is not None:
                last.checksums.append(checksum)
        else:
            self.copy_changes.append(
                KVCopyChange(
                    self.num_copy_changes,
                    request_id,
                    layer,
                    action,
                    tier,
                    bits,
                    [index],
                    num_bytes,
                    [] if checksum is None else [checksum],
                )  # fmt: skip
            )
        self.num_copy_changes += 1

    def take_copy_changes(self) -> list[KVCopyChange]:
        """The copy changes noted since the last call, in order (the engine's step result carries them)."""
        taken, self.copy_changes = self.copy_changes, []
        return taken

    # --- slots ---------------------------------------------------------------------------------
    def _slot_tier(self, name: str, pool: TierPool, device: torch.device) -> SlotTier | None:
        max_slots = pool.budget_bytes // self.bytes_per_block
        if max_slots == 0:
            return None
        tier = SlotTier(
            name,
            self.num_layers,
            self.block_shape,
            self.dtype,
            device,
            min(INITIAL_SLOTS_PER_LAYER, max_slots // self.num_layers),
            max_slots,
        )
        tier.on_moved.append(lambda layer, _: self._repoint(layer))
        return tier

    def _repoint(self, layer: int) -> None:
        """A layer's slot tensor was reallocated: its blocks' views follow it."""
        for table in self.tables.values():
            for block in table[layer]:
                if block.device_slot is not None:
                    block.device = self.device_slots.view(layer, block.device_slot)
                if block.host_slot is not None:
                    block.host = self.host_slots.view(layer, block.host_slot)

    def _reserve_device(self, block: KVBlock, values: torch.Tensor | None) -> None:
        """Give `block` a device slot holding `values` (zeros when None)."""
        if self.device_slots is None:
            raise BudgetError(f"device budget {self.device_pool.budget_bytes} B holds no KV block")
        self.device_pool.reserve(ObjectKind.KV_BLOCK, self.bytes_per_block)
        layer = block.key[1]
        block.device_slot = self.device_slots.take(layer)
        block.device = self.device_slots.view(layer, block.device_slot)
        self.off_device[block.key[0]].discard((layer, block.key[2]))
        if values is None:
            block.device.zero_()
        else:
            block.device.copy_(values)

    def _release_device(self, block: KVBlock) -> None:
        assert self.device_slots is not None and block.device_slot is not None
        self.device_slots.give_back(block.key[1], block.device_slot)
        block.device, block.device_slot = None, None
        if block.key[0] in self.off_device:
            self.off_device[block.key[0]].add((block.key[1], block.key[2]))
        self.device_pool.release(ObjectKind.KV_BLOCK, self.bytes_per_block)

    # --- spilling ------------------------------------------------------------------------------
    def spill_block(self, block: KVBlock, mode: SpillMode, is_behind: bool = False) -> int:
        """Write a copy per `mode`, then free the device slot. Returns bytes written. `is_behind`: disk
        writes are queued, not waited for; their buffers' bytes are charged to `write_behind_pool` (as
        ``Scratch.KV_WRITE_BEHIND``) until :meth:`finish_writes`, and waited for at once where it lacks room."""
        if block.device is None:
            raise EngineError(f"KV block {block.key} is not on device")
        before = self.spill.num_pending_bytes
        behind = self.spill.writing_behind() if is_behind else contextlib.nullcontext()
        with io_context((block.key[0],), IOPriority.KV_WRITE, ":".join(map(str, block.key))), behind:
            written = self._write_copy(block, mode)
        self._release_device(block)
        queued = self.spill.num_pending_bytes - before
        if queued > 0 and self.write_behind_pool.can_reserve(queued):
            self.write_behind_pool.reserve(Scratch.KV_WRITE_BEHIND, queued)
            self.num_behind_bytes += queued
        elif queued > 0:
            self.finish_writes()
        return written

    def finish_writes(self) -> None:
        """Wait for the spill writes in flight and give their bytes back to the budget (a failed one raises
        :class:`EngineError` naming the spill directory and why, as a write waited for at once does)."""
        try:
            self.spill.finish_writes()
        finally:
            self.write_behind_pool.release(Scratch.KV_WRITE_BEHIND, self.num_behind_bytes)
            self.num_behind_bytes = 0

    def _write_copy(self, block: KVBlock, mode: SpillMode) -> int:
        if mode in BOTH_COPIES:
            return sum(self._write_copy(block, part) for part in BOTH_COPIES[mode])
        tensor = block.device.cpu()
        if mode is SpillMode.HOST_FULL and block.host is None:
            if self.host_slots is None:
                raise BudgetError(f"host budget {self.host_pool.budget_bytes} B holds no KV block")
            self.host_pool.reserve(ObjectKind.KV_BLOCK, self.bytes_per_block)
            block.host_slot = self.host_slots.take(block.key[1])
            block.host = self.host_slots.view(block.key[1], block.host_slot)
            block.host.copy_(tensor)
            self.note_copy(CopyAction.WRITTEN, block, Tier.HOST, 0, self.bytes_per_block)
            return self.bytes_per_block
        if mode in (SpillMode.HOST_INT8, SpillMode.HOST_INT4) and block.host_q is None:
            quant = quantize_kv(tensor, 8 if mode is SpillMode.HOST_INT8 else 4, self.key_dim)
            self.host_pool.reserve(ObjectKind.KV_BLOCK, quant.num_bytes)
            block.host_q = quant
            self.note_copy(CopyAction.WRITTEN, block, Tier.HOST, quant.bits, quant.num_bytes, quant_checksum(quant))
            return quant.num_bytes
        if mode is SpillMode.DISK_FULL and block.disk is None:
            block.disk = self.spill.write("kv-" + "-".join(map(str, block.key)), tensor)
            self.note_copy(CopyAction.WRITTEN, block, Tier.DISK, 0, self.bytes_per_block)
            return self.bytes_per_block
        if mode is SpillMode.DISK_INT8 and block.disk_q is None:
            quant = quantize_kv(tensor, 8, self.key_dim)
            block.disk_q = write_quant(self.spill, "kvq-" + "-".join(map(str, block.key)), quant)
            self.note_copy(
                CopyAction.WRITTEN, block, Tier.DISK, quant.bits, block.disk_q.num_bytes, quant_checksum(quant)
            )
            return block.disk_q.num_bytes
        return 0

    def spill_cost_fits_host(self, mode: SpillMode) -> bool:
        """Whether a host copy in `mode` fits the host budget now."""
        if mode is SpillMode.HOST_FULL:
            return self.host_pool.can_reserve(self.bytes_per_block)
        bits = 4 if mode in (SpillMode.HOST_INT4, SpillMode.HOST_FULL_AND_INT4) else 8
        quant_bytes = quant_kv_nbytes(self.block_shape, bits, self.key_dim)
        if mode in (SpillMode.HOST_INT8, SpillMode.HOST_INT4):
            return self.host_pool.can_reserve(quant_bytes)
        if mode in (SpillMode.HOST_FULL_AND_INT8, SpillMode.HOST_FULL_AND_INT4):
            return self.host_pool.can_reserve(self.bytes_per_block + quant_bytes)
        return True

    def _drop_copies(self, block: KVBlock, keep_device: bool) -> None:
        if block.device is not None and not keep_device:
            self._release_device(block)
        if block.host is not None:
            assert self.host_slots is not None and block.host_slot is not None
            self.host_slots.give_back(block.key[1], block.host_slot)
            self.host_pool.release(ObjectKind.KV_BLOCK, self.bytes_per_block)
            block.host, block.host_slot = None, None
            self.note_copy(CopyAction.FREED, block, Tier.HOST, 0)
        self._drop_host_quant(block)
        if block.disk is not None:
            self.spill.delete(block.disk)
            block.disk = None
            self.note_copy(CopyAction.FREED, block, Tier.DISK, 0)
        self._drop_disk_quant(block)

    def drop_quant_copies(self, block: KVBlock) -> None:
        """Free a block's quantized copies (host, then disk), noting each."""
        self._drop_host_quant(block)
        self._drop_disk_quant(block)

    def _drop_host_quant(self, block: KVBlock) -> None:
        if block.host_q is not None:
            self.host_pool.release(ObjectKind.KV_BLOCK, block.host_q.num_bytes)
            self.note_copy(CopyAction.FREED, block, Tier.HOST, block.host_q.bits)
            block.host_q = None

    def _drop_disk_quant(self, block: KVBlock) -> None:
        if block.disk_q is not None:
            for record in block.disk_q.records:
                self.spill.delete(record)
            self.note_copy(CopyAction.FREED, block, Tier.DISK, block.disk_q.bits)
            block.disk_q = None

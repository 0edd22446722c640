"""Runs the model's own forward over packed requests, after making every KV block it reads usable."""

from __future__ import annotations

import dataclasses
import time

import torch
from transformers import PreTrainedModel

from fallbackgate.engine.controller import KVMiss
from fallbackgate.engine.device_pool import Scratch
from fallbackgate.engine.errors import ChecksumError, EngineError
from fallbackgate.engine.experts.executor import Executor
from fallbackgate.engine.kv.layer_read import plan_layer_read, read_layer
from fallbackgate.engine.kv.paged_cache import PagedCache
from fallbackgate.engine.kv.store import KVBlock, RequestBlockKeys, Staged
from fallbackgate.engine.model.compiled import CompiledDecode
from fallbackgate.engine.sequence import Sequence
from fallbackgate.engine.step_context import EventLog, ForwardBatch, StepContext
from fallbackgate.engine.tags import ObjectKind, Tag, Tier


@dataclasses.dataclass(slots=True, frozen=True)
class ServePlan:
    """How one off-device KV block is served this step, as decided before the forward."""

    request_id: str  # the reading request
    tag: Tag  # the tag served (observe mode may serve exactly what the controller would not)
    decided_tag: Tag  # the controller's choice
    note: str  # the decision's reason
    predicted_cost: float  # the controller's predicted cost of `decided_tag` (0 in observe mode)
    quant_bits: int  # bits of the block's quantized copy (0: none)


def nearest_tier(block: KVBlock) -> Tier:
    """The nearest tier holding any copy of an off-device block (full or quantized); a block with no copy at
    all (dropped: it is rebuilt by recompute) counts as ``disk``, the farthest."""
    if block.host is not None or block.host_q is not None:
        return Tier.HOST
    return Tier.DISK


class ModelRunner:
    """Owns the model, the paged cache and the executor; one packed forward per call."""

    def __init__(
        self,
        model: PreTrainedModel,
        executor: Executor,
        num_layers: int,
        device: torch.device,
        dense_flops_per_token: float,
        attn_flops_per_pair: float,
    ) -> None:
        self.model, self.executor, self.device = model, executor, device
        self.cache = PagedCache(executor, num_layers)
        self.dense_flops_per_token = dense_flops_per_token  # 2 × dense parameters
        self.attn_flops_per_pair = attn_flops_per_pair  # per (query, key) pair, all layers
        self.step_kv_keys = RequestBlockKeys()  # blocks the current step reads: never spilled
        self.is_per_layer = False  # the current step stages off-device KV layer by layer
        self.layer_plan: dict[tuple[str, int, int], ServePlan] = {}  # per-layer step: how each read is served
        self.layer_staging_s = 0.0  # wall seconds spent laying out per-layer K/V since the caller last reset it
        self.compiled: CompiledDecode | None = None  # decode forwards' compiled graph (is_decode_compiled)

    # --- KV blocks a step reads ------------------------------------------------------------------
    def resolve_kv(
        self,
        step_id: int,
        chosen: list[tuple[Sequence, int]],
        log: EventLog,
        is_observe: bool,
        is_per_layer: bool = False,
    ) -> None:
        """Decide how every off-device block the chosen requests read is served, and stage it now; with
        `is_per_layer` (the step's KV does not fit the device at once) blocks served by a read are staged
        layer by layer during the forward instead (`layer_update`); rebuilt ones are staged now either way,
        and the recompute passes run."""
        kv = self.executor.kv_store
        self.step_kv_keys = kv.block_keys([seq.request_id for seq, _ in chosen])
        self.executor.step_request_ids = [seq.request_id for seq, _ in chosen]
        self.layer_plan.clear()
        self.is_per_layer = is_per_layer
        for seq, _ in chosen:
            start = seq.num_computed_tokens
            rebuild_from: int | None = None
            for block in kv.off_device_blocks(seq.request_id, start // kv.block_size):  # layer, then index
                if block.key not in kv.scratch:
                    tag = self._serve_block(step_id, seq, block, log, is_observe)
                    if seq.request_id in log.failed:  # unreadable and not rebuildable: it leaves the step
                        break
                    if tag is Tag.RECOMPUTE:
                        index = block.key[2]
                        rebuild_from = index if rebuild_from is None else min(rebuild_from, index)
            if rebuild_from is not None and seq.request_id not in log.failed:
                self._recompute(step_id, seq, rebuild_from * kv.block_size, start, log, is_observe)

    def _miss(self, step_id: int, seq: Sequence, block: KVBlock) -> KVMiss:
        kv = self.executor.kv_store
        exact_tier = Tier.HOST if block.host is not None else Tier.DISK if block.disk is not None else None
        quant = block.host_q or block.disk_q
        quant_tier = Tier.HOST if block.host_q is not None else Tier.DISK if block.disk_q is not None else None
        return KVMiss(
            step_id,
            seq.request_id,
            seq.request_class,
            block.key[1],
            block.key[2],
            exact_tier,
            quant_tier,
            quant.bits if quant else 0,
            kv.bytes_per_block,
        )

    def _decide(self, step_id: int, seq: Sequence, block: KVBlock, is_observe: bool) -> ServePlan:
        miss = self._miss(step_id, seq, block)
        exact_tier, quant_tier = miss.exact_tier, miss.quant_tier
        quant = block.host_q or block.disk_q
        decision = self.executor.controller.kv_action(miss)
        tag, note = decision.tag, decision.reason
        if is_observe and tag is not Tag.EXACT_LOAD:  # observe serves exactly: the full copy, else a rebuild
            served = Tag.EXACT_LOAD if exact_tier else Tag.RECOMPUTE
            note, tag = (f"observe: would serve {tag.value}" if served is not tag else note), served
        if (tag is Tag.EXACT_LOAD and exact_tier is None) or (tag is Tag.KV_DEQUANT and quant_tier is None):
            raise EngineError(f"controller chose {tag.value} for KV block {block.key} which has no such copy")
        cost = decision.predicted_cost if not is_observe else 0.0
        return ServePlan(seq.request_id, tag, decision.tag, note, cost, quant.bits if quant else 0)

    def _serve_block(self, step_id: int, seq: Sequence, block: KVBlock, log: EventLog, is_observe: bool) -> Tag:
        """Decide, then stage now (or, per layer, leave a read for the layer's update); returns the tag."""
        plan = self._decide(step_id, seq, block, is_observe)
        if self.is_per_layer and plan.tag is not Tag.RECOMPUTE:
            self.layer_plan[block.key] = plan
            return plan.tag
        note = plan.note
        before, started_ns = nearest_tier(block), time.perf_counter_ns()
        try:
            staged = self._stage(block, plan.tag)
        except ChecksumError as exc:
            fault = f"KV block {block.key}: {exc}"
            decided = self.executor.controller.kv_fault_action(self._miss(step_id, seq, block), fault)
            if decided is None or decided.tag is not Tag.RECOMPUTE:  # its class may not rebuild: it fails alone
                log.fail(seq.request_id, f"unreadable KV spill: {fault}")
                return Tag.RECOMPUTE
            staged, note = self._stage(block, Tag.RECOMPUTE), decided.reason or f"{fault}; recovered by recompute"
        self._log_staged(log, block, staged, plan, note, (before, time.perf_counter_ns() - started_ns))
        return staged.tag

    def _log_staged(
        self, log: EventLog, block: KVBlock, staged: Staged, plan: ServePlan, note: str, waited: tuple[Tier, int]
    ) -> None:
        """Record a staged block (`waited`: its tier before and the measured ns the step waited for it)."""
        if log.capture is not None:
            log.capture.kv_served[block.key] = (waited[0], staged.tag, staged.bytes_moved, waited[1])
        log.add_transfer(
            self.executor.profile,
            plan.request_id,
            block.key[1],
            ObjectKind.KV_BLOCK,
            staged.tag,
            staged.bytes_moved,
            staged.source_tier,
            predicted_cost=plan.predicted_cost if staged.tag is plan.decided_tag else 0.0,
            note=note,
            object_id=block.key[2] if staged.tag is not Tag.EXACT_LOAD else None,
            bits=plan.quant_bits if staged.tag is Tag.KV_DEQUANT else 0,
        )
        self.executor.uses.used_kv_block_keys.append(block.key)
        log.add_staging(block.key, staged.tag, staged.bytes_moved)

    # --- per-layer staging -----------------------------------------------------------------------
    def layer_update(
        self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The executor's KV update in a per-layer step: write this forward's K/V, then lay out each
        request's K/V of `layer` in one buffer, reading its off-device blocks into their places; the
        buffer's bytes are held (KV_GATHER for copied resident blocks, KV_STAGED for staged ones) until the
        executor releases the layer's gather."""
        started = time.perf_counter()
        try:
            return self._layer_update(layer, key_states, value_states)
        finally:
            self.layer_staging_s += time.perf_counter() - started

    def _layer_update(
        self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        executor, kv = self.executor, self.executor.kv_store
        batch = executor.ctx.batch
        executor.release_gather()
        reads = []
        for request_id, start, length in zip(batch.request_ids, batch.starts, batch.lengths, strict=True):
            reads.append(plan_layer_read(kv, request_id, layer, start + length))
        resident = sum(r.num_resident for r in reads if r.num_blocks > 1) * kv.bytes_per_block
        staged = sum(r.num_staged for r in reads) * kv.bytes_per_block
        what = f"layer {layer}'s K/V laid out for attention"
        executor.ensure_room(resident + staged, what, pinned_kv=self.step_kv_keys)
        kv.device_pool.reserve(Scratch.KV_GATHER, resident)
        executor.num_gather_bytes_held = resident
        kv.device_pool.reserve(Scratch.KV_STAGED, staged)
        executor.num_staged_bytes_held = staged
        offset = 0
        for request_id, start, length in zip(batch.request_ids, batch.starts, batch.lengths, strict=True):
            kv.write(request_id, layer, start, key_states[0, :, offset : offset + length],
                     value_states[0, :, offset : offset + length])  # fmt: skip
            self._prefetch_exact(request_id, layer, start + length)
            try:
                executor.layer_kv.append(read_layer(kv, request_id, layer, start + length, self._stage_into))
            finally:
                self._drop_prefetched()
            num_resident = kv.num_device_blocks(request_id, layer, start + length)
            if num_resident:
                executor.ctx.log.add_kv_reads(request_id, layer, num_resident)
            offset += length
        return key_states, value_states

    def _stage_into(self, block: KVBlock, out: torch.Tensor) -> None:
        """Read an off-device block, as decided before the forward, into its place `out` of a layer buffer."""
        kv, plan = self.executor.kv_store, self.layer_plan.get(block.key)
        if plan is None:
            raise EngineError(f"KV block {block.key} read by a per-layer step but not planned")
        before, started_ns = nearest_tier(block), time.perf_counter_ns()
        is_prefetched = block.key in kv.pending_exact  # its read copy's room is held since it was queued
        if not is_prefetched:
            need = kv.stage_bytes(block, plan.tag)
            what = f"staging KV block {block.key} ({plan.tag.value})"
            self.executor.ensure_room(need, what, pinned_kv=self.step_kv_keys)
            kv.device_pool.reserve(Scratch.KV_STAGED, kv.bytes_per_block)  # the read copy, until it is placed
        try:
            staged = kv.load(block, plan.tag)
            out.copy_(staged.tensor)
            staged.tensor = out  # the read copy is dropped here
        except ChecksumError as exc:  # a per-layer step cannot rebuild it mid-forward: its request fails alone
            self.executor.ctx.log.fail(block.key[0], f"unreadable KV spill: KV block {block.key}: {exc}")
            out.zero_()
            return
        finally:
            kv.device_pool.release(Scratch.KV_STAGED, kv.bytes_per_block)
        waited = (before, time.perf_counter_ns() - started_ns)
        self._log_staged(self.executor.ctx.log, block, staged, plan, plan.note, waited)

    def _prefetch_exact(self, request_id: str, layer: int, length: int) -> None:
        """Queue the disk reads of a request layer's exactly staged blocks together, so they are in flight at
        once (the disk sees the queue): as many as the device pool has room for their read copies, one
        block's room left free."""
        kv = self.executor.kv_store
        blocks = [
            b
            for b in kv.blocks(request_id, layer)[: -(-length // kv.block_size)]
            if b.device is None and b.key not in kv.scratch and b.host is None and b.disk is not None
            and b.key in self.layer_plan and self.layer_plan[b.key].tag is Tag.EXACT_LOAD
        ]  # fmt: skip
        room = kv.device_pool.free_bytes // kv.bytes_per_block - 1
        if len(blocks) < 2 or room < 2:
            return
        for block in blocks[:room]:
            kv.device_pool.reserve(Scratch.KV_STAGED, kv.bytes_per_block)
            kv.submit_exact(block)

    def _drop_prefetched(self) -> None:
        """Reads queued ahead that no staging took (the layer read failed): waited for, their room given back."""
        kv = self.executor.kv_store
        for key in list(kv.pending_exact):
            kv.drop_pending(key)
            kv.device_pool.release(Scratch.KV_STAGED, kv.bytes_per_block)

    def _recompute(self, step_id: int, seq: Sequence, begin: int, end: int, log: EventLog, is_observe: bool) -> None:
        """Re-run the model over tokens [begin, end) so their KV is rebuilt into the staged blocks."""
        kv = self.executor.kv_store
        for layer in range(kv.num_layers):  # blocks in the range that are readable need no rebuild
            for block in kv.blocks(seq.request_id, layer)[begin // kv.block_size : -(-end // kv.block_size)]:
                if block.device is None and block.key not in kv.scratch:
                    self._stage(block, Tag.RECOMPUTE)
        token_ids = seq.all_token_ids[begin:end]
        batch = ForwardBatch(
            [seq.request_id], [begin], [end - begin], torch.zeros(end - begin, dtype=torch.long), [seq.request_class]
        )
        log.is_rebuild_pass = True
        try:
            self.forward(step_id, batch, token_ids, [], log, is_observe=is_observe)
        finally:
            log.is_rebuild_pass = False
        log.mark_rebuilt(seq.request_id)

    def _stage(self, block: KVBlock, tag: Tag) -> Staged:
        """Stage `block` after making device room for it (never by spilling this step's blocks)."""
        kv = self.executor.kv_store
        what = f"staged KV block {block.key} ({tag.value})"
        self.executor.ensure_room(kv.stage_bytes(block, tag), what, pinned_kv=self.step_kv_keys)
        return kv.stage(block, tag)

    # --- forward -------------------------------------------------------------------------------
    def forward(
        self,
        step_id: int,
        batch: ForwardBatch,
        token_ids: list[int],
        logits_rows: list[int],
        log: EventLog,
        is_observe: bool,
    ) -> torch.Tensor:
        """One packed forward; returns fp32 logits at `logits_rows` of the packed tokens."""
        batch.token_owner = batch.token_owner.to(self.device)
        ctx = StepContext(step_id, batch, log, is_observe=is_observe)
        self.executor.ctx = ctx
        if len(token_ids) == len(batch.starts):  # a decode: one token per request
            positions = torch.tensor(batch.starts)
        else:
            positions = torch.cat([torch.arange(s, s + n) for s, n in zip(batch.starts, batch.lengths, strict=True)])
        input_ids = torch.tensor([token_ids], device=self.device)
        keep = torch.tensor(logits_rows or [len(token_ids) - 1], device=self.device)
        self.executor.kv_layer_update = self.layer_update if self.is_per_layer else None
        model = self.model
        if self.compiled is not None and self.compiled.takes(batch, log.is_rebuild_pass):
            model = self.compiled.run
        try:
            with torch.inference_mode():
                out = model(
                    input_ids=input_ids,
                    position_ids=positions[None].to(self.device),
                    cache=self.cache,
                    use_cache=True,
                    logits_to_keep=keep,
                )
        finally:
            self.executor.kv_layer_update = None
            self.executor.release_gather()
            self.executor.uses.used_expert_keys.extend(ctx.used_expert_keys)
            self.executor.uses.deferred_expert_keys.extend(ctx.deferred_expert_keys)
            self.executor.ctx = None
        pairs = sum(n * s + n * (n + 1) / 2 for s, n in zip(batch.starts, batch.lengths, strict=True))
        log.modeled_compute_s += self.executor.profile.device_compute_s(
            self.dense_flops_per_token * len(token_ids) + self.attn_flops_per_pair * pairs
        )
        return out.logits[0].float()

"""Runs the model's own forward over packed requests, after making every KV block it reads usable."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from fallbackgate.engine.controller import KVMiss
from fallbackgate.engine.errors import ChecksumError, EngineError
from fallbackgate.engine.experts.executor import Executor
from fallbackgate.engine.kv.paged_cache import PagedCache
from fallbackgate.engine.kv.store import KVBlock, Staged
from fallbackgate.engine.sequence import Sequence
from fallbackgate.engine.step_context import EventLog, ForwardBatch, StepContext
from fallbackgate.engine.tags import ObjectKind, Tag, Tier


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
        self.step_kv_keys: set[tuple[str, int, int]] = set()  # blocks the current step reads: never spilled

    # --- KV blocks a step reads ------------------------------------------------------------------
    def resolve_kv(self, step_id: int, chosen: list[tuple[Sequence, int]], log: EventLog, is_observe: bool) -> None:
        """Stage or rebuild every off-device block the chosen requests read; run recompute passes."""
        kv = self.executor.kv_store
        self.step_kv_keys = kv.block_keys([seq.request_id for seq, _ in chosen])
        for seq, _ in chosen:
            start = seq.num_computed_tokens
            rebuild_from: int | None = None
            for layer in range(kv.num_layers):
                for block in kv.blocks(seq.request_id, layer)[: start // kv.block_size]:
                    if block.device is None and block.key not in kv.scratch:
                        tag = self._stage_block(step_id, seq, block, log, is_observe)
                        if tag is Tag.RECOMPUTE:
                            index = block.key[2]
                            rebuild_from = index if rebuild_from is None else min(rebuild_from, index)
            if rebuild_from is not None:
                self._recompute(step_id, seq, rebuild_from * kv.block_size, start, log, is_observe)

    def _stage_block(self, step_id: int, seq: Sequence, block: KVBlock, log: EventLog, is_observe: bool) -> Tag:
        kv, profile = self.executor.kv_store, self.executor.profile
        exact_tier = Tier.HOST if block.host is not None else Tier.DISK if block.disk is not None else None
        quant = block.host_q or block.disk_q
        quant_tier = Tier.HOST if block.host_q is not None else Tier.DISK if block.disk_q is not None else None
        decision = self.executor.controller.kv_action(
            KVMiss(
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
        )
        tag, note = decision.tag, decision.reason
        if is_observe and tag is not Tag.EXACT_LOAD:  # observe serves exactly: the full copy, else a rebuild
            served = Tag.EXACT_LOAD if exact_tier else Tag.RECOMPUTE
            note, tag = (f"observe: would serve {tag.value}" if served is not tag else note), served
        if (tag is Tag.EXACT_LOAD and exact_tier is None) or (tag is Tag.KV_DEQUANT and quant_tier is None):
            raise EngineError(f"controller chose {tag.value} for KV block {block.key} which has no such copy")
        try:
            staged = self._stage(block, tag)
        except ChecksumError as exc:
            staged, note = self._stage(block, Tag.RECOMPUTE), f"{exc}; recovered by recompute"
        cost = decision.predicted_cost if staged.tag is decision.tag and not is_observe else 0.0
        log.add_transfer(
            profile,
            seq.request_id,
            block.key[1],
            ObjectKind.KV_BLOCK,
            staged.tag,
            staged.bytes_moved,
            staged.source_tier,
            predicted_cost=cost,
            note=note,
            object_id=block.key[2] if staged.tag is not Tag.EXACT_LOAD else None,
            bits=quant.bits if staged.tag is Tag.KV_DEQUANT and quant else 0,
        )
        self.executor.uses.used_kv_block_keys.append(block.key)
        log.add_staging(block.key, staged.tag, staged.bytes_moved)
        return staged.tag

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
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(batch.starts, batch.lengths, strict=True)])
        input_ids = torch.tensor([token_ids], device=self.device)
        keep = torch.tensor(logits_rows or [len(token_ids) - 1], device=self.device)
        try:
            with torch.inference_mode():
                out = self.model(
                    input_ids=input_ids,
                    position_ids=positions[None].to(self.device),
                    cache=self.cache,
                    use_cache=True,
                    logits_to_keep=keep,
                )
        finally:
            self.executor.release_gather()
            self.executor.uses.used_expert_keys.extend(ctx.used_expert_keys)
            self.executor.uses.deferred_expert_keys.extend(ctx.deferred_expert_keys)
            self.executor.ctx = None
        pairs = sum(n * s + n * (n + 1) / 2 for s, n in zip(batch.starts, batch.lengths, strict=True))
        log.modeled_compute_s += self.executor.profile.device_compute_s(
            self.dense_flops_per_token * len(token_ids) + self.attn_flops_per_pair * pairs
        )
        return out.logits[0].float()

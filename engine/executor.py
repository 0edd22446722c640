"""Performs a forward's expert and KV work through the stores, as the controller decides."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fallbackgate.engine.controller import Controller, EngineView
from fallbackgate.engine.errors import EngineError
from fallbackgate.engine.expert_store import ExpertKey, ExpertStore, ExpertWeights
from fallbackgate.engine.experts_hook import (
    ExpertUse,
    expert_mlp,
    fetch_for_tag,
    plan_expert_uses,
    renormalise_deferred,
    served_tag,
)
from fallbackgate.engine.hardware import HardwareProfile
from fallbackgate.engine.kv_store import KVBlockKey, KVStore, SpillMode
from fallbackgate.engine.step_context import StepContext
from fallbackgate.engine.tags import ObjectKind, Tag, Tier


class Executor:
    """Owns the stores and the controller; the experts hook and the paged cache call into it."""

    def __init__(
        self,
        expert_store: ExpertStore,
        kv_store: KVStore,
        controller: Controller,
        profile: HardwareProfile,
        hidden_size: int,
        intermediate_size: int,
    ) -> None:
        self.expert_store, self.kv_store, self.controller, self.profile = expert_store, kv_store, controller, profile
        self.flops_per_expert_token = 6.0 * hidden_size * intermediate_size
        self.hidden_size = hidden_size
        self.ctx: StepContext | None = None
        self.pending_modeled_s = 0.0  # spill traffic between forwards, charged to the next step
        self.view_factory: Callable[[], EngineView] = lambda: None  # set by the engine
        self.used_expert_keys: list[ExpertKey] = []  # experts computed this step, in order
        self.used_kv_block_keys: list[KVBlockKey] = []  # off-device KV blocks read this step
        self.deferred_expert_keys: list[ExpertKey] = []  # experts deferred this step

    # --- experts -------------------------------------------------------------------------------
    def run_experts(
        self,
        module: torch.nn.Module,
        layer: int,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """Compute the routed experts of one layer for the packed tokens of this forward."""
        ctx = self.ctx
        if ctx is None:
            raise EngineError("experts called outside an engine step")
        if ctx.is_exact_baseline:
            return self._exact_experts(module, layer, hidden, top_k_index, top_k_weights)
        uses = plan_expert_uses(self, layer, top_k_index, top_k_weights)
        weights = renormalise_deferred(top_k_weights, uses, ctx.is_observe)
        out = torch.zeros_like(hidden)
        by_key: dict[ExpertKey, list[ExpertUse]] = {}
        for use in uses:
            by_key.setdefault(use.key, []).append(use)
        for key, key_uses in by_key.items():
            self._run_expert(module, key, key_uses, hidden, weights, out)
        return out

    def _run_expert(
        self,
        module: torch.nn.Module,
        key: ExpertKey,
        uses: list[ExpertUse],
        hidden: torch.Tensor,
        weights: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        ctx = self.ctx
        is_still_resident = self.expert_store.is_on_device(key)  # a load earlier in this layer may have evicted it
        if len(uses) == 1 and uses[0].decision.tag is Tag.RESIDENT and is_still_resident:  # common case, kept lean
            self._run_resident(module, uses[0], hidden, weights, out)
            return
        groups: dict[Tag, list[ExpertUse]] = {}
        for use in uses:
            tag = served_tag(use, ctx.is_observe)
            groups.setdefault(Tag.EXACT_LOAD if tag is Tag.RESIDENT else tag, []).append(use)
        for tag, tag_uses in groups.items():
            if tag is Tag.EXPERT_DEFER:
                for use in tag_uses:
                    self._record(use, Tag.EXPERT_DEFER, 0, None, 0.0, "")
                ctx.deferred_expert_keys.append(key)
                continue
            was_resident = self.expert_store.is_on_device(key)
            fetch_tag = Tag.RESIDENT if tag is Tag.EXACT_LOAD and was_resident else tag
            fetched = fetch_for_tag(self, key, fetch_tag)
            if len(tag_uses) == 1:
                token_idx, top_k_pos = tag_uses[0].token_idx, tag_uses[0].top_k_pos
            else:
                token_idx = torch.cat([u.token_idx for u in tag_uses])
                top_k_pos = torch.cat([u.top_k_pos for u in tag_uses])
            x = hidden[token_idx]
            if tag is Tag.CPU_EXECUTE:
                y = expert_mlp(module, x.to("cpu"), fetched.weights).to(hidden.device)  # the model's dtype, on CPU
                compute_s = self.profile.cpu_compute_s(self.flops_per_expert_token * len(token_idx))
                activations_s = self.profile.transfer_s(2 * x.numel() * x.element_size(), Tier.HOST)  # there and back
            else:
                y = expert_mlp(module, x, fetched.weights)
                compute_s = self.profile.device_compute_s(self.flops_per_expert_token * len(token_idx))
                activations_s = 0.0
            out.index_add_(0, token_idx, (y * weights[token_idx, top_k_pos, None]).to(out.dtype))  # as eager does
            ctx.log.modeled_compute_s += compute_s
            ctx.used_expert_keys.append(key)
            target = Tier.HOST if tag is Tag.CPU_EXECUTE else Tier.DEVICE
            transfer_s = activations_s + (
                self.profile.transfer_s(fetched.bytes_moved, fetched.source_tier, target)
                if fetched.source_tier
                else 0.0
            )
            ctx.log.modeled_transfer_s += transfer_s
            for i, use in enumerate(tag_uses):
                served = fetch_tag if i == 0 else (Tag.RESIDENT if fetch_tag is Tag.EXACT_LOAD else fetch_tag)
                moved = fetched.bytes_moved if i == 0 else 0
                self._record(
                    use,
                    served,
                    moved,
                    fetched.source_tier if moved else None,
                    transfer_s if i == 0 else 0.0,
                    fetched.note if i == 0 else "",
                )

    def _run_resident(
        self, module: torch.nn.Module, use: ExpertUse, hidden: torch.Tensor, weights: torch.Tensor, out: torch.Tensor
    ) -> None:
        """One request's tokens through an expert already on device: compute, account, record `resident`."""
        ctx, token_idx = self.ctx, use.token_idx
        y = expert_mlp(module, hidden[token_idx], self.expert_store.device_weights(use.key))
        out.index_add_(0, token_idx, (y * weights[token_idx, use.top_k_pos, None]).to(out.dtype))
        ctx.log.modeled_compute_s += self.profile.device_compute_s(self.flops_per_expert_token * len(token_idx))
        ctx.used_expert_keys.append(use.key)
        ctx.log.add(ctx.batch.request_ids[use.request_index], use.key[0], ObjectKind.EXPERT, Tag.RESIDENT)

    def _record(self, use: ExpertUse, tag: Tag, moved: int, tier: Tier | None, modeled_s: float, note: str) -> None:
        ctx = self.ctx
        decided = use.decision.tag
        if decided is not Tag.RESIDENT and use.decision.reason:
            note = (note + "; " if note else "") + use.decision.reason
        if ctx.is_observe and decided not in (Tag.RESIDENT, Tag.EXACT_LOAD, tag):
            note = (note + "; " if note else "") + f"observe: would serve {decided.value}"
        cost = use.decision.predicted_cost if not ctx.is_observe else 0.0
        ctx.log.add(
            ctx.batch.request_ids[use.request_index],
            use.key[0],
            ObjectKind.EXPERT,
            tag,
            bytes_moved=moved,
            source_tier=tier,
            predicted_cost=cost,
            modeled_s=modeled_s,
            note=note,
        )

    def _exact_experts(
        self,
        module: torch.nn.Module,
        layer: int,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for expert_id in torch.unique(top_k_index).tolist():
            token_idx, pos = torch.where(top_k_index == expert_id)
            key = (layer, int(expert_id))
            home = self.expert_store.reader.read(key)  # from the checkpoint files, checked against the manifest
            weights = ExpertWeights(home.gate_up.to(hidden.device), home.down.to(hidden.device))
            y = expert_mlp(module, hidden[token_idx], weights)
            out.index_add_(0, token_idx, (y * top_k_weights[token_idx, pos, None]).to(out.dtype))
        return out

    # --- KV (called by the paged cache) --------------------------------------------------------
    def kv_update(
        self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this forward's K/V into the blocks, return every request's full K/V packed along tokens."""
        batch = self.ctx.batch
        keys, values = [], []
        offset = 0
        for request_id, start, length in zip(batch.request_ids, batch.starts, batch.lengths, strict=True):
            new_k = key_states[0, :, offset : offset + length]
            new_v = value_states[0, :, offset : offset + length]
            self.kv_store.write(request_id, layer, start, new_k, new_v)
            k, v = self.kv_store.gather(request_id, layer, start + length)
            keys.append(k)
            values.append(v)
            offset += length
        if len(keys) == 1:
            return keys[0][None], values[0][None]
        return torch.cat(keys, dim=1)[None], torch.cat(values, dim=1)[None]

    # --- room on device ------------------------------------------------------------------------
    def make_room(
        self,
        num_bytes: int,
        *,
        pinned_experts: set[ExpertKey] | None = None,
        pinned_kv: set[KVBlockKey] | None = None,
        is_kv_evictable: bool = True,
        is_done: Callable[[], bool] | None = None,
    ) -> bool:
        """Ask the controller for victims until `is_done()` (default: `num_bytes` free); True when it is."""
        pool = self.expert_store.device_pool
        is_done = is_done or (lambda: pool.can_reserve(num_bytes))
        if is_done():
            return True
        view: EngineView = self.view_factory()
        victims = self.controller.choose_victims(
            num_bytes - pool.free_bytes, view, pinned_experts or set(), pinned_kv or set()
        )
        for victim in victims:
            if victim.expert_key is not None and self.expert_store.is_on_device(victim.expert_key):
                if victim.expert_key not in (pinned_experts or set()):
                    self.expert_store.evict(victim.expert_key)
            elif victim.kv_block_key is not None and is_kv_evictable:
                self.spill_kv(victim.kv_block_key, victim.spill_mode)
            if is_done():
                return True
        return is_done()

    def spill_kv(self, key: KVBlockKey, mode: SpillMode) -> None:
        """Take a KV block off device, keeping the copy `mode` names (host falls back to disk when full)."""
        request_id, layer, index = key
        block = self.kv_store.blocks(request_id, layer)[index]
        if block.device is None:
            return
        if not self.kv_store.spill_cost_fits_host(mode):
            mode = SpillMode.DISK_INT8 if mode in (SpillMode.HOST_INT8, SpillMode.HOST_INT4) else SpillMode.DISK_FULL
        written = self.kv_store.spill_block(block, mode)
        target = Tier.DISK if mode in (SpillMode.DISK_FULL, SpillMode.DISK_INT8) else Tier.HOST
        self.pending_modeled_s += self.profile.transfer_s(written, Tier.DEVICE, target) if written else 0.0

"""Performs a forward's expert and KV work through the stores, as the controller decides."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Container

import torch

from fallbackgate.engine.baseline.expert_copies import DEFAULT_CACHE_BYTES, AuditWeights
from fallbackgate.engine.controller import Controller, ControllerView
from fallbackgate.engine.device_pool import Scratch
from fallbackgate.engine.errors import BudgetError, EngineError
from fallbackgate.engine.experts.dispatch import ExpertDispatch
from fallbackgate.engine.experts.grouped import stacked_forward
from fallbackgate.engine.experts.store import ExpertKey, ExpertStore
from fallbackgate.engine.experts.weights import ExpertWeights
from fallbackgate.engine.hardware import HardwareProfile
from fallbackgate.engine.kv.block import DISK_FALLBACK, DISK_MODES, FULL_COPY_MODES
from fallbackgate.engine.kv.store import KVBlockKey, KVStore, RequestBlockKeys, SpillMode
from fallbackgate.engine.messages import RoutingCall
from fallbackgate.engine.step_context import StepContext, StepUses
from fallbackgate.engine.tags import Tier

KVLayerUpdate = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class Executor:
    """Owns the stores and the controller; the experts hook and the paged cache call into it."""

    def __init__(
        self,
        expert_store: ExpertStore,
        kv_store: KVStore,
        controller: Controller,
        profile: HardwareProfile,
        *,
        view: ControllerView,
        uses: StepUses,
        hidden_size: int,
        intermediate_size: int,
        routers: dict[int, torch.nn.Module],
        top_k: int,
        audit_cache_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        """`view` is what the controller is shown, `uses` where the step's uses are kept for it; `routers`
        maps each decoder layer to its router (read-ahead prediction), `top_k` is experts per token, and
        `audit_cache_bytes` bounds the baselines' own verified expert copies."""
        self.expert_store, self.kv_store, self.controller, self.profile = expert_store, kv_store, controller, profile
        self.view, self.uses = view, uses
        self.num_expert_params = 3 * hidden_size * intermediate_size
        self.hidden_size = hidden_size
        self.ctx: StepContext | None = None
        self.pending_modeled_s = 0.0  # spill traffic between forwards, charged to the next step
        self.num_gather_bytes_held = 0  # device pool bytes of the current layer's gathered K/V
        self.num_staged_bytes_held = 0  # device pool bytes of the current layer's per-layer staged KV blocks
        # set by the model runner for a step whose KV is staged layer by layer: replaces `kv_update`'s body
        self.kv_layer_update: KVLayerUpdate | None = None
        self.routers, self.top_k = routers, top_k
        self.step_request_ids: list[str] = []  # the step's requests (the model runner sets them each step)
        self.layer_kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # per request K, V of the current layer
        self.audit_weights = AuditWeights(expert_store.reader, audit_cache_bytes)  # the baselines' expert copies
        self.dispatch = ExpertDispatch(expert_store, controller, view, profile, self, routers, top_k,
                                       self.num_expert_params)  # fmt: skip

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
        self.release_gather()  # attention of this layer is done: its gathered K/V is garbage
        if ctx.replay is not None:
            return ctx.replay.experts(module, layer, hidden, top_k_index, top_k_weights)
        if ctx.is_exact_baseline:
            return self._exact_experts(module, layer, hidden, top_k_index, top_k_weights)
        capture = ctx.log.capture
        if capture is not None:
            capture.routing.append(RoutingCall(layer, ctx.batch.request_ids, ctx.batch.token_owner, top_k_index,
                                               top_k_weights, capture.named.pop(layer, None)))  # fmt: skip
        return self.dispatch.run(module, layer, hidden, top_k_index, top_k_weights)

    def _exact_experts(
        self,
        module: torch.nn.Module,
        layer: int,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """The exact baseline: the baselines' own verified copies of the layer's experts, stacked for the
        same grouped kernel the served path runs."""
        ids = torch.unique(top_k_index).tolist()
        lut = torch.full((int(ids[-1]) + 1,), -1, dtype=torch.int64, device=top_k_index.device)
        lut[torch.as_tensor(ids, device=top_k_index.device)] = torch.arange(len(ids), device=top_k_index.device)

        def load(slot: int) -> ExpertWeights:
            return self.audit_weights.get((layer, int(ids[slot])), hidden.device)

        return stacked_forward(module, load, len(ids), hidden, lut[top_k_index], top_k_weights)

    # --- KV (called by the paged cache) --------------------------------------------------------
    def kv_update(
        self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this forward's K/V into the blocks and gather each request's full K/V for the paged
        attention function (`layer_kv`, in packing order); returns this forward's own K/V unchanged.

        Gathered copies are counted in the device pool (Scratch.KV_GATHER) until this layer's attention
        is done: the next experts call, the next layer's update, or the end of the forward releases them.
        """
        if self.kv_layer_update is not None:
            return self.kv_layer_update(layer, key_states, value_states)
        batch = self.ctx.batch
        self.release_gather()
        num_bytes = self.kv_store.gather_bytes([s + n for s, n in zip(batch.starts, batch.lengths, strict=True)])
        self.ensure_room(num_bytes, f"layer {layer}'s gathered K/V")
        self.kv_store.device_pool.reserve(Scratch.KV_GATHER, num_bytes)
        self.num_gather_bytes_held = num_bytes
        self.layer_kv = []
        offset = 0
        for request_id, start, length in zip(batch.request_ids, batch.starts, batch.lengths, strict=True):
            new_k = key_states[0, :, offset : offset + length]
            new_v = value_states[0, :, offset : offset + length]
            self.kv_store.write(request_id, layer, start, new_k, new_v)
            self.layer_kv.append(self.kv_store.gather(request_id, layer, start + length))
            num_resident = self.kv_store.num_device_blocks(request_id, layer, start + length)
            if num_resident:  # staged blocks were recorded when staged; these are read where they live
                self.ctx.log.add_kv_reads(request_id, layer, num_resident)
            offset += length
        return key_states, value_states

    def release_gather(self) -> None:
        """Give back the pool bytes of the last gathered K/V and drop the references to it."""
        self.layer_kv = []
        if self.num_gather_bytes_held:
            self.kv_store.device_pool.release(Scratch.KV_GATHER, self.num_gather_bytes_held)
            self.num_gather_bytes_held = 0
        if self.num_staged_bytes_held:
            self.kv_store.device_pool.release(Scratch.KV_STAGED, self.num_staged_bytes_held)
            self.num_staged_bytes_held = 0

    # --- room on device ------------------------------------------------------------------------
    def step_kv_keys(self) -> RequestBlockKeys:
        """Every KV block of the requests in the current forward and of the step's requests (a rebuild pass
        runs before the step's own forward, whose blocks are already resolved: they are read, never spilled)."""
        ids = list(self.ctx.batch.request_ids) if self.ctx is not None else []
        return self.kv_store.block_keys(ids + [r for r in self.step_request_ids if r not in ids])

    def ensure_room(
        self, num_bytes: int, what: str, *, pinned_kv: Container[KVBlockKey] | None = None, is_kv_evictable: bool = True
    ) -> None:
        """Free `num_bytes` of the device pool for a buffer (evicting as the controller chooses) or raise."""
        if self.expert_store.device_pool.can_reserve(num_bytes):
            return
        pinned = self.step_kv_keys() if pinned_kv is None else pinned_kv
        if not self.make_room(num_bytes, pinned_kv=pinned, is_kv_evictable=is_kv_evictable):
            pool = self.expert_store.device_pool
            raise BudgetError(
                f"device budget {pool.budget_bytes} B cannot hold {what} ({num_bytes} B, {pool.free_bytes} B free "
                "after eviction); raise --device-budget-mb"
            )

    def make_room(
        self,
        num_bytes: int,
        *,
        pinned_experts: Container[ExpertKey] | None = None,
        pinned_kv: Container[KVBlockKey] | None = None,
        is_kv_evictable: bool = True,
        is_done: Callable[[], bool] | None = None,
    ) -> bool:
        """Ask the controller for victims until `is_done()` (default: `num_bytes` free); True when it is."""
        pool = self.expert_store.device_pool
        is_done = is_done or (lambda: pool.can_reserve(num_bytes))
        self.expert_store.drop_lowbit(num_bytes, is_done)  # on a CPU kept low-bit copies go first (remade)
        if is_done():
            return True
        if not is_kv_evictable:  # every block pinned, so a controller's victim order need not walk KV
            pinned_kv = self.kv_store.block_keys(list(self.kv_store.tables))
        victims = self.controller.choose_victims(
            num_bytes - pool.free_bytes, self.view, pinned_experts or set(), pinned_kv or set()
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

    def spill_kv(self, key: KVBlockKey, mode: SpillMode, is_behind: bool = False) -> None:
        """Take a KV block off device, keeping the copies `mode` names (host falls back to disk when full or
        absent: a quantized copy to an int8 one, both copies to both, anything else to a full copy);
        `is_behind`: its disk writes are queued, not waited for (``KVStore.spill_block``)."""
        request_id, layer, index = key
        block = self.kv_store.blocks(request_id, layer)[index]
        if block.device is None or block.key != key or self.kv_store.is_held(key):
            return  # a shared block in use (or an alias of one) stays in the fast tier
        if block.num_tokens < self.kv_store.block_size and mode not in FULL_COPY_MODES:
            mode = SpillMode.HOST_FULL  # a partial tail is written to again: it comes back exactly, so a full copy
        if not self.kv_store.spill_cost_fits_host(mode):
            mode = DISK_FALLBACK.get(mode, SpillMode.DISK_FULL)
        written = self.kv_store.spill_block(block, mode, is_behind)
        target = Tier.DISK if mode in DISK_MODES else Tier.HOST
        self.pending_modeled_s += self.profile.transfer_s(written, Tier.DEVICE, target) if written else 0.0

    # --- step end ------------------------------------------------------------------------------
    def end_step(self, spill: list[tuple[KVBlockKey, SpillMode]], is_behind: bool = False) -> None:
        """Spill the KV blocks the controller chose (those of live requests that still exist; `is_behind`:
        their disk writes not waited for) and forget the step's uses."""
        with self.kv_store.spill.writing_behind() if is_behind else contextlib.nullcontext():  # queued together
            for key, mode in spill:
                request_id, layer, index = key
                if request_id in self.kv_store.tables and index < len(self.kv_store.blocks(request_id, layer)):
                    self.spill_kv(key, mode, is_behind)
        self.uses.clear()

    def take_pending_modeled_s(self) -> float:
        """Link time of spills since the last forward (charged to the next step), reset to zero."""
        seconds, self.pending_modeled_s = self.pending_modeled_s, 0.0
        return seconds

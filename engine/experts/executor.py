"""Performs a forward's expert and KV work through the stores, as the controller decides."""

from __future__ import annotations

import time
from collections.abc import Callable, Container

import torch
from transformers.integrations.moe import grouped_mm_experts_forward

from fallbackgate.engine.baseline.expert_copies import DEFAULT_CACHE_BYTES, AuditWeights
from fallbackgate.engine.controller import Controller, ControllerView
from fallbackgate.engine.device_pool import Scratch
from fallbackgate.engine.errors import BudgetError, EngineError
from fallbackgate.engine.experts.faults import expert_miss, fault_decision, rescale_late_defers
from fallbackgate.engine.experts.hook import (
    ExpertUse,
    expert_mlp,
    fetch_for_tag,
    group_routing,
    plan_expert_uses,
    renormalise_deferred,
    served_tag,
)
from fallbackgate.engine.experts.quarantine import ExpertQuarantined
from fallbackgate.engine.experts.store import ExpertKey, ExpertStore, Fetched
from fallbackgate.engine.hardware import HardwareProfile
from fallbackgate.engine.io.context import IOPriority, io_context
from fallbackgate.engine.kv.store import KVBlockKey, KVStore, RequestBlockKeys, SpillMode
from fallbackgate.engine.messages import RoutingCall
from fallbackgate.engine.step_context import StepContext, StepUses
from fallbackgate.engine.tags import ObjectKind, Tag, Tier

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
        self.layer_kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # per request K, V of the current layer
        self.step_request_ids: list[str] = []  # the step's requests (the model runner sets them each step)
        self.audit_weights = AuditWeights(expert_store.reader, audit_cache_bytes)  # the baselines' expert copies

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
        if layer in self.expert_store.stacked_layers:
            return self._run_stacked(module, layer, hidden, top_k_index, top_k_weights)
        uses = plan_expert_uses(ctx, self.expert_store, self.controller, layer, top_k_index, top_k_weights)
        if self.expert_store.is_disk_tiered and self.expert_store.num_read_slots:
            self._start_reads(layer, hidden, uses)
        weights = renormalise_deferred(top_k_weights, uses, ctx.is_observe)
        out = torch.zeros_like(hidden)
        by_key: dict[ExpertKey, list[ExpertUse]] = {}
        for use in uses:
            by_key.setdefault(use.key, []).append(use)
        late: list[tuple[torch.Tensor, torch.Tensor]] = []  # uses deferred when their expert's read failed
        for key, key_uses in by_key.items():
            self._run_expert(module, key, key_uses, hidden, weights, out, late)
        rescale_late_defers(out, weights, late)
        return out

    def _start_reads(self, layer: int, hidden: torch.Tensor, uses: list[ExpertUse]) -> None:
        """Queue disk reads of this layer's misses (they proceed while earlier experts compute), then of the
        experts the next layer's router picks for this layer's hidden state (pre-gating), as the controller
        allows; those run while this layer computes."""
        needed = [u.key for u in uses if u.decision.tag in (Tag.EXACT_LOAD, Tag.CPU_EXECUTE)]
        predicted: list[ExpertKey] = []
        router = self.routers.get(layer + 1)
        if router is not None:
            logits = torch.nn.functional.linear(hidden.to(router.weight.dtype), router.weight)
            ids = torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1).indices.unique().tolist()
            predicted = self.controller.choose_read_ahead([(layer + 1, e) for e in ids], self.view)
            if self.ctx.log.capture is not None:
                self.ctx.log.capture.named[layer + 1] = ids
        with io_context(self.ctx.batch.request_ids):  # read ahead for this forward's requests
            self.expert_store.queue_reads(list(dict.fromkeys(needed)), predicted, self.ctx.step_id)

    def _run_expert(
        self,
        module: torch.nn.Module,
        key: ExpertKey,
        uses: list[ExpertUse],
        hidden: torch.Tensor,
        weights: torch.Tensor,
        out: torch.Tensor,
        late: list[tuple[torch.Tensor, torch.Tensor]],
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
                self._defer(key, tag_uses)
                continue
            was_resident = self.expert_store.is_on_device(key)
            fetch_tag = Tag.RESIDENT if tag is Tag.EXACT_LOAD and was_resident else tag
            scratch_bytes = self.expert_store.lowbit_scratch_bytes if tag is Tag.EXPERT_LOWBIT else 0
            if scratch_bytes:
                self.ensure_room(scratch_bytes, f"the dequantized low-bit copy of expert {key}", is_kv_evictable=False)
            try:
                with self.expert_store.device_pool.held(Scratch.EXPERT_DEQUANT, scratch_bytes):
                    self._compute_tagged(module, key, tag, fetch_tag, tag_uses, hidden, weights, out)
            except ExpertQuarantined as exc:  # its read failed twice: each request defers it or fails alone
                for use in tag_uses:
                    top = float(weights[use.token_idx, use.top_k_pos].max())
                    miss = expert_miss(ctx, self.expert_store, key, use.request_index, len(use.token_idx), top)
                    use.decision = fault_decision(self.controller, miss, exc.record)
                    if not use.decision.failure:
                        late.append((use.token_idx, use.top_k_pos))
                self._defer(key, tag_uses)

    def _defer(self, key: ExpertKey, uses: list[ExpertUse]) -> None:
        """Record deferred uses (their load queued); a use that carries a failure fails its request instead."""
        for use in uses:
            if use.decision.failure:
                self.ctx.log.fail(self.ctx.batch.request_ids[use.request_index], use.decision.failure)
            else:
                self._record(use, Tag.EXPERT_DEFER, 0, None, 0.0, "", 0)
        if not any(use.decision.is_forced for use in uses):  # a quarantined expert is never loaded again
            self.ctx.deferred_expert_keys.append(key)

    def _compute_tagged(
        self,
        module: torch.nn.Module,
        key: ExpertKey,
        tag: Tag,
        fetch_tag: Tag,
        tag_uses: list[ExpertUse],
        hidden: torch.Tensor,
        weights: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """Fetch `key` as `fetch_tag` says, compute its uses, accumulate into `out`, and record them."""
        ctx = self.ctx
        request_ids = tuple(dict.fromkeys(ctx.batch.request_ids[u.request_index] for u in tag_uses))
        with io_context(request_ids, IOPriority.EXPERT_MISS, f"{key[0]}:{key[1]}") as io:  # its disk reads
            started_ns = time.perf_counter_ns()
            fetched = fetch_for_tag(self.expert_store, key, fetch_tag, self.make_room)
            wait_ns = time.perf_counter_ns() - started_ns if fetch_tag is not Tag.RESIDENT else 0
        if fetch_tag is not Tag.RESIDENT:
            ctx.log.add_expert_arrival(request_ids, key, fetch_tag, fetched.bytes_moved, io.last_end_ns)
        if len(tag_uses) == 1:
            token_idx, top_k_pos = tag_uses[0].token_idx, tag_uses[0].top_k_pos
        else:
            token_idx = torch.cat([u.token_idx for u in tag_uses])
            top_k_pos = torch.cat([u.top_k_pos for u in tag_uses])
        x = hidden[token_idx]
        if tag is Tag.CPU_EXECUTE:
            y = expert_mlp(module, x.to("cpu"), fetched.weights).to(hidden.device)  # the model's dtype, on CPU
            compute_s = self._expert_s(len(token_idx), hidden, on_cpu=True)
            activations_s = self.profile.transfer_s(2 * x.numel() * x.element_size(), Tier.HOST)  # there and back
        else:
            y = expert_mlp(module, x, fetched.weights)
            compute_s = self._expert_s(len(token_idx), hidden, on_cpu=False)
            activations_s = 0.0
        out.index_add_(0, token_idx, (y * weights[token_idx, top_k_pos, None]).to(out.dtype))  # as eager does
        ctx.log.modeled_compute_s += compute_s
        ctx.used_expert_keys.append(key)
        # on a CPU a disk read lands in RAM, where the expert computes (no host-to-device leg)
        target = Tier.HOST if tag is Tag.CPU_EXECUTE or self.expert_store.is_ram_tiered else Tier.DEVICE
        transfer_s = activations_s + (
            self.profile.transfer_s(fetched.bytes_moved, fetched.source_tier, target) if fetched.source_tier else 0.0
        )
        ctx.log.modeled_transfer_s += transfer_s
        self._record_fetched(tag_uses, fetch_tag, fetched, transfer_s, wait_ns)

    def _record_fetched(
        self, uses: list[ExpertUse], fetch_tag: Tag, fetched: Fetched, transfer_s: float, wait_ns: int
    ) -> None:
        """The first use carries the fetch (bytes, source, modeled and measured time); later uses reuse the
        fetched weights."""
        first, *rest = uses
        moved = fetched.bytes_moved
        self._record(first, fetch_tag, moved, fetched.source_tier if moved else None, transfer_s, fetched.note,
                     wait_ns)  # fmt: skip
        reused = Tag.RESIDENT if fetch_tag is Tag.EXACT_LOAD else fetch_tag
        for use in rest:
            self._record(use, reused, 0, None, 0.0, "", 0)

    def _run_stacked(
        self,
        module: torch.nn.Module,
        layer: int,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """Every expert of the layer is resident in its stack: one grouped matmul per projection, exactly
        transformers' `grouped_mm` experts path; each (expert, request) use is counted `resident`."""
        ctx = self.ctx
        out = grouped_mm_experts_forward(module, hidden, top_k_index, top_k_weights)
        experts: set[int] = set()
        for expert_id, request_index in group_routing(ctx.token_owner, top_k_index, top_k_weights):
            ctx.log.add_expert_uses(ctx.batch.request_ids[request_index], layer, 1)
            ctx.used_expert_keys.append((layer, expert_id))
            experts.add(expert_id)
        if experts:  # modeled as the per-expert path is: one call per expert used, its tokens spread evenly
            per_expert = max(1, top_k_index.numel() // len(experts))
            ctx.log.modeled_compute_s += len(experts) * self._expert_s(per_expert, hidden, on_cpu=False)
        return out

    def _run_resident(
        self, module: torch.nn.Module, use: ExpertUse, hidden: torch.Tensor, weights: torch.Tensor, out: torch.Tensor
    ) -> None:
        """One request's tokens through an expert already on device: compute, account, count it `resident`."""
        ctx, token_idx = self.ctx, use.token_idx
        y = expert_mlp(module, hidden[token_idx], self.expert_store.device_weights(use.key))
        out.index_add_(0, token_idx, (y * weights[token_idx, use.top_k_pos, None]).to(out.dtype))
        ctx.log.modeled_compute_s += self._expert_s(len(token_idx), hidden, on_cpu=False)
        ctx.used_expert_keys.append(use.key)
        ctx.log.add_expert_uses(ctx.batch.request_ids[use.request_index], use.key[0], 1)

    def _expert_s(self, num_tokens: int, hidden: torch.Tensor, on_cpu: bool) -> float:
        """Predicted (modeled) seconds of one expert call from the profile's measured curve."""
        weight_bytes = self.num_expert_params * hidden.element_size()
        dtype = str(hidden.dtype).removeprefix("torch.")
        return self.profile.expert_s(num_tokens, weight_bytes, self.num_expert_params, on_cpu, dtype)

    def _record(
        self, use: ExpertUse, tag: Tag, moved: int, tier: Tier | None, modeled_s: float, note: str, wait_ns: int
    ) -> None:
        ctx = self.ctx
        request_id = ctx.batch.request_ids[use.request_index]
        if ctx.log.capture is not None and (tag is not Tag.RESIDENT or moved):
            before = tier if moved and tier is not None else self.expert_store.home(use.key)
            call = len(ctx.log.capture.routing) - 1
            ctx.log.capture.expert_served.append((call, use.key[1], request_id, before, tag, moved, wait_ns))
        decided = use.decision.tag
        if decided is not Tag.RESIDENT and use.decision.reason:
            note = (note + "; " if note else "") + use.decision.reason
        if ctx.is_observe and decided not in (Tag.RESIDENT, Tag.EXACT_LOAD, tag):
            note = (note + "; " if note else "") + f"observe: would serve {decided.value}"
        cost = use.decision.predicted_cost if not ctx.is_observe else 0.0
        ctx.log.add(
            request_id,
            use.key[0],
            ObjectKind.EXPERT,
            tag,
            bytes_moved=moved,
            source_tier=tier,
            predicted_cost=cost,
            modeled_s=modeled_s,
            note=note,
            object_id=use.key[1] if tag.is_approximate else None,
            bits=self.expert_store.lowbit_bits if tag is Tag.EXPERT_LOWBIT else 0,
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
            weights = self.audit_weights.get((layer, int(expert_id)), hidden.device)
            y = expert_mlp(module, hidden[token_idx], weights)
            out.index_add_(0, token_idx, (y * top_k_weights[token_idx, pos, None]).to(out.dtype))
        return out

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

    # --- step end ------------------------------------------------------------------------------
    def end_step(self, spill: list[tuple[KVBlockKey, SpillMode]]) -> None:
        """Spill the KV blocks the controller chose (those of live requests that still exist) and forget the
        step's uses."""
        for key, mode in spill:
            request_id, layer, index = key
            if request_id in self.kv_store.tables and index < len(self.kv_store.blocks(request_id, layer)):
                self.spill_kv(key, mode)
        self.uses.clear()

    def take_pending_modeled_s(self) -> float:
        """Link time of spills since the last forward (charged to the next step), reset to zero."""
        seconds, self.pending_modeled_s = self.pending_modeled_s, 0.0
        return seconds

"""One MoE layer's routed experts: routing grouped once, misses decided per (expert, request), every exact
expert computed in one grouped kernel over the slot pool.

Per layer: `group_layer` makes the one host copy; each miss is put to the controller; `exact_load`s are
placed into free slots (every expert the layer uses is pinned while they are, so no load evicts an expert
this layer still reads; when the budget cannot hold the layer's whole working set the rows ready so far
are computed first and their experts unpinned); `cpu_execute` and `expert_lowbit` uses compute their
rows through the same kernel on a one-slot stack; `expert_defer` rows are omitted and their tokens'
weights renormalised. All rows are reduced once per token, as transformers' grouped forward does.
"""

from __future__ import annotations

import time
from collections.abc import Container
from typing import Protocol

import numpy as np
import torch

from fallbackgate.engine.controller import Controller, ControllerView, Decision
from fallbackgate.engine.device_pool import Scratch
from fallbackgate.engine.errors import EngineError
from fallbackgate.engine.experts.faults import expert_miss, fault_decision, rescale_late_defers
from fallbackgate.engine.experts.grouped import grouped_rows, single_expert_rows, sum_rows
from fallbackgate.engine.experts.hook import ExpertUse, fetch_for_tag, renormalise_deferred, served_tag
from fallbackgate.engine.experts.quarantine import ExpertQuarantined
from fallbackgate.engine.experts.routing import LayerRouting, MissUse, group_layer, row_owner
from fallbackgate.engine.experts.served import LayerRows, group_by_key, record_fetched, record_use
from fallbackgate.engine.experts.store import ExpertKey, ExpertStore, Fetched
from fallbackgate.engine.hardware import HardwareProfile
from fallbackgate.engine.io.context import IOPriority, io_context
from fallbackgate.engine.step_context import StepContext
from fallbackgate.engine.tags import Tag, Tier


class RoomMaker(Protocol):
    """What the dispatch needs of the executor: the current step and device room on demand."""

    ctx: StepContext | None

    def make_room(
        self, num_bytes: int, *, pinned_experts: Container[ExpertKey] | None = None, is_kv_evictable: bool = True
    ) -> bool: ...

    def ensure_room(self, num_bytes: int, what: str, *, is_kv_evictable: bool = True) -> None: ...


class ExpertDispatch:
    """Computes routed experts for the executor, through the store and as the controller decides."""

    def __init__(
        self,
        store: ExpertStore,
        controller: Controller,
        view: ControllerView,
        profile: HardwareProfile,
        host: RoomMaker,
        routers: dict[int, torch.nn.Module],
        top_k: int,
        num_expert_params: int,
    ) -> None:
        self.store, self.controller, self.view, self.profile, self.host = store, controller, view, profile, host
        self.routers, self.top_k, self.num_expert_params = routers, top_k, num_expert_params

    @property
    def ctx(self) -> StepContext:
        ctx = self.host.ctx
        if ctx is None:
            raise EngineError("experts called outside an engine step")
        return ctx

    def run(
        self,
        module: torch.nn.Module,
        layer: int,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """The layer's routed experts for the packed tokens of this forward."""
        ctx, store = self.ctx, self.store
        num_tokens, top_k = top_k_index.shape
        request_ids = ctx.batch.request_ids
        table = store.slots.table(layer)
        row_slots = table[top_k_index.reshape(-1)]  # gathered once: the routing's host copy and the kernel's slots
        owner = row_owner(ctx.token_owner, top_k)
        routing = group_layer(top_k_index, top_k_weights, table, owner, len(request_ids), row_slots)
        for request_index in np.flatnonzero(routing.resident_uses):
            ctx.log.add_expert_uses(request_ids[request_index], layer, int(routing.resident_uses[request_index]))
        ctx.used_expert_keys.extend((layer, int(e)) for e in routing.used_experts)
        num_rows = num_tokens * top_k
        ctx.log.modeled_compute_s += len(routing.used_experts) * self._expert_s(
            max(1, num_rows // max(1, len(routing.used_experts))), hidden, on_cpu=False
        )
        store.wait_layer_ready(layer)
        if not routing.misses:  # everything resident: one kernel, no host work beyond the counts
            return sum_rows(
                self._kernel(module, layer, hidden, row_slots, top_k_weights.reshape(-1), top_k),
                num_tokens,
                top_k,
                hidden.dtype,
            )
        return self._run_with_misses(module, layer, hidden, top_k_weights, routing)

    def _run_with_misses(
        self,
        module: torch.nn.Module,
        layer: int,
        hidden: torch.Tensor,
        top_k_weights: torch.Tensor,
        routing: LayerRouting,
    ) -> torch.Tensor:
        ctx, store = self.ctx, self.store
        num_tokens, top_k = top_k_weights.shape
        uses = [
            ExpertUse((layer, m.expert_id), m.request_index, m.rows, self._decide(layer, m)) for m in routing.misses
        ]
        if store.is_disk_tiered and store.num_read_slots:
            self._start_reads(layer, hidden, uses)
        by_tag: dict[Tag, list[ExpertUse]] = {}
        for use in uses:
            by_tag.setdefault(served_tag(use.decision, ctx.is_observe), []).append(use)
        deferred = by_tag.get(Tag.EXPERT_DEFER, [])
        weights = top_k_weights
        if deferred:
            mask = np.zeros(num_tokens * top_k, dtype=bool)
            mask[np.concatenate([u.rows for u in deferred])] = True
            weights = renormalise_deferred(
                top_k_weights, torch.as_tensor(mask, device=hidden.device).view_as(top_k_weights)
            )
            self._defer(deferred)
        flat_weights = weights.reshape(-1)
        out = LayerRows(num_tokens * top_k)
        slots = routing.slots.copy()
        late: list[np.ndarray] = []  # rows deferred when their expert's read failed (after others computed)
        loads = by_tag.get(Tag.EXACT_LOAD, [])
        self._load_all(module, layer, hidden, flat_weights, loads, routing, slots, out, late)
        for tag in (Tag.CPU_EXECUTE, Tag.EXPERT_LOWBIT):
            for key, key_uses in group_by_key(by_tag.get(tag, [])).items():
                try:
                    self._run_single(module, key, tag, key_uses, hidden, flat_weights, out)
                except ExpertQuarantined as exc:
                    self._late_defer(key_uses, exc, flat_weights, late)
        self._flush(module, layer, hidden, flat_weights, slots, out)
        if out.rows is None:
            return torch.zeros_like(hidden)
        result = sum_rows(out.rows, num_tokens, top_k, hidden.dtype)
        rows = [torch.as_tensor(r, device=hidden.device) for r in late]
        rescale_late_defers(result, weights, [(r // top_k, r % top_k) for r in rows])
        return result

    def _decide(self, layer: int, miss: MissUse) -> Decision:
        """The controller's action for one (expert, request) miss; a quarantined expert's is forced."""
        key = (layer, miss.expert_id)
        asked = expert_miss(self.ctx, self.store, key, miss.request_index, len(miss.rows), miss.top_weight)
        record = self.store.reader.quarantine.get(key)
        return fault_decision(self.controller, asked, record) if record else self.controller.expert_action(asked)

    def _defer(self, uses: list[ExpertUse]) -> None:
        """Record deferred uses (their loads queued, never a quarantined expert's); a use that carries a
        failure fails its request instead."""
        ctx = self.ctx
        for use in uses:
            if use.decision.failure:
                ctx.log.fail(ctx.batch.request_ids[use.request_index], use.decision.failure)
            else:
                record_use(ctx, self.store, use, Tag.EXPERT_DEFER, 0, None, 0.0, "", 0)
        forced = {u.key for u in uses if u.decision.is_forced}
        ctx.deferred_expert_keys.extend(dict.fromkeys(u.key for u in uses if u.key not in forced))

    def _late_defer(
        self, uses: list[ExpertUse], exc: ExpertQuarantined, flat_weights: torch.Tensor, late: list[np.ndarray]
    ) -> None:
        """An expert whose read failed twice mid-layer: each request defers it (its rows rescaled out at the
        end of the layer) or fails alone."""
        for use in uses:
            top = float(flat_weights[torch.as_tensor(use.rows, device=flat_weights.device)].max())
            asked = expert_miss(self.ctx, self.store, use.key, use.request_index, len(use.rows), top)
            use.decision = fault_decision(self.controller, asked, exc.record)
            if not use.decision.failure:
                late.append(use.rows)
        self._defer(uses)

    def _load_all(
        self,
        module: torch.nn.Module,
        layer: int,
        hidden: torch.Tensor,
        flat_weights: torch.Tensor,
        loads: list[ExpertUse],
        routing: LayerRouting,
        slots: np.ndarray,
        out: LayerRows,
        late: list[np.ndarray],
    ) -> None:
        """Place every expert an `exact_load` use needs (each once), with the layer's experts pinned; set the
        slots of the rows they serve (a quarantined expert's rows stay unset: deferred or failed)."""
        store, by_key = self.store, group_by_key(loads)
        pins = {(layer, int(e)) for e in np.unique(routing.experts[routing.slots >= 0])} | set(by_key)
        for key, key_uses in by_key.items():
            if not store.can_place(key) and not self.host.make_room(
                store.place_bytes, pinned_experts=pins, is_kv_evictable=False
            ):  # the layer's working set does not fit at once: compute what is ready, then unpin it
                self._flush(module, layer, hidden, flat_weights, slots, out)
                pins = {k for k in pins if k in by_key and not store.is_on_device(k)} | {key}
            try:
                self._load(key, key_uses, pins)
            except ExpertQuarantined as exc:
                self._late_defer(key_uses, exc, flat_weights, late)
                continue
            slot = store.slots.slot_of[key]
            for use in key_uses:
                slots[use.rows] = slot

    def _load(self, key: ExpertKey, uses: list[ExpertUse], pins: set[ExpertKey]) -> None:
        """One expert placed for its exact uses (a load earlier in the layer may have placed it already)."""
        ctx, store = self.ctx, self.store
        fetch_tag = Tag.RESIDENT if store.is_on_device(key) else Tag.EXACT_LOAD
        request_ids = tuple(dict.fromkeys(ctx.batch.request_ids[u.request_index] for u in uses))

        def make_room(num_bytes: int, **_: object) -> bool:
            return self.host.make_room(num_bytes, pinned_experts=pins, is_kv_evictable=False)

        with io_context(request_ids, IOPriority.EXPERT_MISS, f"{key[0]}:{key[1]}") as io:  # its disk reads
            started_ns = time.perf_counter_ns()
            fetched = fetch_for_tag(store, key, fetch_tag, make_room)
            wait_ns = time.perf_counter_ns() - started_ns if fetch_tag is not Tag.RESIDENT else 0
        if fetch_tag is not Tag.RESIDENT:
            ctx.log.add_expert_arrival(request_ids, key, fetch_tag, fetched.bytes_moved, io.last_end_ns)
        target = Tier.HOST if store.is_ram_tiered else Tier.DEVICE
        transfer_s = (
            self.profile.transfer_s(fetched.bytes_moved, fetched.source_tier, target) if fetched.source_tier else 0.0
        )
        ctx.log.modeled_transfer_s += transfer_s
        self._record_fetched(uses, fetch_tag, fetched, transfer_s, wait_ns)

    def _flush(
        self,
        module: torch.nn.Module,
        layer: int,
        hidden: torch.Tensor,
        flat_weights: torch.Tensor,
        slots: np.ndarray,
        out: LayerRows,
    ) -> None:
        """Compute every row whose expert now holds a slot and that is not computed yet, in one kernel."""
        todo = np.flatnonzero((slots >= 0) & ~out.is_done)
        if not len(todo):
            return
        pending = np.full_like(slots, -1)
        pending[todo] = slots[todo]
        self.store.wait_layer_ready(layer)
        top_k = len(slots) // hidden.shape[0]
        rows = self._kernel(module, layer, hidden, torch.as_tensor(pending, device=hidden.device), flat_weights, top_k)
        out.put(todo, rows[torch.as_tensor(todo, device=hidden.device)])

    def _kernel(
        self,
        module: torch.nn.Module,
        layer: int,
        hidden: torch.Tensor,
        slots: torch.Tensor,
        flat_weights: torch.Tensor,
        top_k: int,
    ) -> torch.Tensor:
        gate_up, down, base = self.store.kernel_stack(layer)
        if base:
            slots = torch.where(slots >= 0, slots - base, slots)
        return grouped_rows(module, gate_up, down, hidden, slots, flat_weights, top_k)

    def _run_single(
        self,
        module: torch.nn.Module,
        key: ExpertKey,
        tag: Tag,
        uses: list[ExpertUse],
        hidden: torch.Tensor,
        flat_weights: torch.Tensor,
        out: LayerRows,
    ) -> None:
        """cpu_execute or expert_lowbit: one expert's rows through the kernel on a one-slot stack."""
        ctx, store = self.ctx, self.store
        scratch_bytes = store.lowbit_scratch_bytes if tag is Tag.EXPERT_LOWBIT else 0
        if scratch_bytes:
            self.host.ensure_room(scratch_bytes, f"the dequantized low-bit copy of expert {key}", is_kv_evictable=False)
        request_ids = tuple(dict.fromkeys(ctx.batch.request_ids[u.request_index] for u in uses))
        rows = np.sort(np.concatenate([u.rows for u in uses]))
        with store.device_pool.held(Scratch.EXPERT_DEQUANT, scratch_bytes):
            with io_context(request_ids, IOPriority.EXPERT_MISS, f"{key[0]}:{key[1]}") as io:
                started_ns = time.perf_counter_ns()
                fetched = fetch_for_tag(store, key, tag, self.host.make_room)
                wait_ns = time.perf_counter_ns() - started_ns
            ctx.log.add_expert_arrival(request_ids, key, tag, fetched.bytes_moved, io.last_end_ns)
            idx = torch.as_tensor(rows, device=hidden.device)
            x, w = hidden[idx // (len(out.is_done) // hidden.shape[0])], flat_weights[idx]
            if tag is Tag.CPU_EXECUTE:  # the model's dtype, on the CPU, where the host copy is
                y = single_expert_rows(module, fetched.weights, x.to("cpu"), w.to("cpu")).to(hidden.device)
                activations_s = self.profile.transfer_s(2 * x.numel() * x.element_size(), Tier.HOST)  # there and back
            else:
                y = single_expert_rows(module, fetched.weights, x, w)
                activations_s = 0.0
        out.put(rows, y)
        ctx.log.modeled_compute_s += self._expert_s(len(rows), hidden, on_cpu=tag is Tag.CPU_EXECUTE)
        target = Tier.HOST if tag is Tag.CPU_EXECUTE or store.is_ram_tiered else Tier.DEVICE
        transfer_s = activations_s + (
            self.profile.transfer_s(fetched.bytes_moved, fetched.source_tier, target) if fetched.source_tier else 0.0
        )
        ctx.log.modeled_transfer_s += transfer_s
        self._record_fetched(uses, tag, fetched, transfer_s, wait_ns)

    def _start_reads(self, layer: int, hidden: torch.Tensor, uses: list[ExpertUse]) -> None:
        """Queue disk reads of this layer's misses (they proceed while earlier experts compute), then of the
        experts the next layer's router picks for this layer's hidden state (pre-gating), as the controller
        allows."""
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
            self.store.queue_reads(list(dict.fromkeys(needed)), predicted, self.ctx.step_id)

    def _record_fetched(
        self, uses: list[ExpertUse], fetch_tag: Tag, fetched: Fetched, transfer_s: float, wait_ns: int
    ) -> None:
        record_fetched(self.ctx, self.store, uses, fetch_tag, fetched, transfer_s, wait_ns)

    def _expert_s(self, num_tokens: int, hidden: torch.Tensor, on_cpu: bool) -> float:
        """Predicted (modeled) seconds of one expert call from the profile's measured curve."""
        weight_bytes = self.num_expert_params * hidden.element_size()
        dtype = str(hidden.dtype).removeprefix("torch.")
        return self.profile.expert_s(num_tokens, weight_bytes, self.num_expert_params, on_cpu, dtype)

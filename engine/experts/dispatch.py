"""One MoE layer's routed experts: routing grouped once, misses decided per (expert, request), every exact
expert computed in one grouped kernel over the slot pool.

Per layer: `group_layer` makes the one host copy; each miss is put to the controller; `exact_load`s are
placed into free slots (every expert the layer uses is pinned while they are, so no load evicts an expert
this layer still reads; when the budget cannot hold the layer's whole working set the rows ready so far
are computed first and their experts unpinned); the disk reads of persisted low-bit copies are queued
before the exact rows compute; then `cpu_execute` and `expert_lowbit` uses compute their rows one expert at a
time (the kernel's per-group matmul on the rows as they are); `expert_defer` rows are omitted and their tokens'
weights renormalised. All rows are reduced once per token, as transformers' grouped forward does.
"""

from __future__ import annotations

import numpy as np
import torch

from fallbackgate.engine.controller import Controller, ControllerView, Decision
from fallbackgate.engine.errors import EngineError
from fallbackgate.engine.experts.faults import expert_miss, fault_decision, rescale_late_defers
from fallbackgate.engine.experts.grouped import grouped_rows, sum_rows
from fallbackgate.engine.experts.hook import ExpertUse, renormalise_deferred, served_tag
from fallbackgate.engine.experts.lowbit_ahead import LowbitReadAhead
from fallbackgate.engine.experts.miss_fetch import MissFetching, RoomMaker
from fallbackgate.engine.experts.quarantine import ExpertQuarantined
from fallbackgate.engine.experts.routing import LayerRouting, MissUse, group_layer, request_digests, row_owner
from fallbackgate.engine.experts.served import LayerRows, group_by_key, record_use
from fallbackgate.engine.experts.store import ExpertStore
from fallbackgate.engine.hardware import HardwareProfile
from fallbackgate.engine.step_context import StepContext
from fallbackgate.engine.tags import ObjectKind, Tag


class ExpertDispatch(MissFetching):
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
        self.lowbit_ahead = LowbitReadAhead(store)

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
        flat = top_k_index.reshape(-1)
        if table.device.type == "cpu":  # looked up on the host: the routing's host arrays view these tensors
            row_slots = torch.from_numpy(table.numpy()[flat.numpy()])
        else:  # gathered once: the routing's host copy and the kernel's slots
            row_slots = table[flat]
        owner = ctx.row_owner
        if owner is None or len(owner) != len(flat):
            owner = ctx.row_owner = row_owner(ctx.token_owner, top_k)
        routing = group_layer(top_k_index, top_k_weights, table, owner, len(request_ids), row_slots)
        self._count_resident(layer, routing)
        if not ctx.log.is_rebuild_pass:
            digests = request_digests(routing.experts, top_k, ctx.batch.starts, ctx.batch.lengths)
            for request_id, digest in zip(request_ids, digests, strict=True):
                ctx.log.add_routing(request_id, layer, digest)
        ctx.used_expert_keys.extend((layer, e) for e in routing.used_experts.tolist())
        num_rows = num_tokens * top_k
        ctx.log.modeled_compute_s += len(routing.used_experts) * self._expert_s(
            max(1, num_rows // max(1, len(routing.used_experts))), hidden, on_cpu=False
        )
        store.wait_layer_ready(layer)
        if not routing.misses:  # everything resident: one kernel, no host work beyond the counts
            return sum_rows(
                self._kernel(module, layer, hidden, row_slots, top_k_weights.reshape(-1), top_k, routing.slots),
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
        routed = tuple(routing.used_experts.tolist())
        uses = [
            ExpertUse((layer, m.expert_id), m.request_index, m.rows, self._decide(layer, m, routed))
            for m in routing.misses
        ]
        if store.is_disk_tiered and store.num_read_slots:
            self._start_reads(layer, hidden, uses)
        by_tag: dict[Tag, list[ExpertUse]] = {}
        for use in uses:
            by_tag.setdefault(served_tag(use.decision, ctx.is_observe), []).append(use)
        weights = self._weights_after_defers(top_k_weights, by_tag.get(Tag.EXPERT_DEFER, []))
        flat_weights = weights.reshape(-1)
        out = LayerRows(num_tokens * top_k)
        slots = routing.slots.copy()
        late: list[np.ndarray] = []  # rows deferred when their expert's read failed (after others computed)
        loads = by_tag.get(Tag.EXACT_LOAD, [])
        self._load_all(module, layer, hidden, flat_weights, loads, routing, slots, out, late)
        try:
            self._read_lowbit_ahead(by_tag.get(Tag.EXPERT_LOWBIT, []))
            self._flush(module, layer, hidden, flat_weights, slots, out)
            for tag in (Tag.CPU_EXECUTE, Tag.EXPERT_LOWBIT):
                for key, key_uses in group_by_key(by_tag.get(tag, [])).items():
                    try:
                        self._run_single(module, key, tag, key_uses, hidden, flat_weights, out)
                    except ExpertQuarantined as exc:
                        self._late_defer(key_uses, exc, flat_weights, late)
        finally:
            self.lowbit_ahead.settle()
        if out.rows is None:
            return torch.zeros_like(hidden)
        result = sum_rows(out.rows, num_tokens, top_k, hidden.dtype)
        rows = [torch.as_tensor(r, device=hidden.device) for r in late]
        rescale_late_defers(result, weights, [(r // top_k, r % top_k) for r in rows])
        return result

    def _weights_after_defers(self, top_k_weights: torch.Tensor, deferred: list[ExpertUse]) -> torch.Tensor:
        """The router weights with the deferred uses' rows dropped and the rest renormalised (unchanged when
        nothing is deferred); the deferrals are recorded."""
        if not deferred:
            return top_k_weights
        mask = np.zeros(top_k_weights.numel(), dtype=bool)
        mask[np.concatenate([u.rows for u in deferred])] = True
        weights = renormalise_deferred(
            top_k_weights, torch.as_tensor(mask, device=top_k_weights.device).view_as(top_k_weights)
        )
        self._defer(deferred)
        return weights

    def _read_lowbit_ahead(self, uses: list[ExpertUse]) -> None:
        """Queue the reads of the persisted low-bit copies `uses` run from, to arrive while the exact rows
        compute (see `LowbitReadAhead`)."""
        if not uses:
            return
        request_ids = self.ctx.batch.request_ids
        keys = {
            key: tuple(dict.fromkeys(request_ids[u.request_index] for u in key_uses))
            for key, key_uses in group_by_key(uses).items()
        }
        self.lowbit_ahead.start(keys, lambda num_bytes: self.host.make_room(num_bytes, is_kv_evictable=False))

    def _count_resident(self, layer: int, routing: LayerRouting) -> None:
        """Count the layer's resident uses per request: on the step's rows, or as rebuild events in a KV
        rebuild pass (they are that pass's work, which the audit's KV reconciliation looks for)."""
        log, request_ids = self.ctx.log, self.ctx.batch.request_ids
        for request_id, count in zip(request_ids, routing.resident_uses.tolist(), strict=True):
            if not count:
                continue
            if log.is_rebuild_pass:
                log.add(request_id, layer, ObjectKind.EXPERT, Tag.RESIDENT, count=count)
            else:
                log.add_expert_uses(request_id, layer, count)

    def _decide(self, layer: int, miss: MissUse, routed: tuple[int, ...]) -> Decision:
        """The controller's action for one (expert, request) miss (`routed`: the layer's routed experts); a
        quarantined expert's is forced."""
        key = (layer, miss.expert_id)
        asked = expert_miss(self.ctx, self.store, key, miss.request_index, len(miss.rows), miss.top_weight, routed)
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
        device_pending = torch.as_tensor(pending, device=hidden.device)
        rows = self._kernel(module, layer, hidden, device_pending, flat_weights, top_k, pending)
        out.put(todo, rows[torch.as_tensor(todo, device=hidden.device)])

    def _kernel(
        self,
        module: torch.nn.Module,
        layer: int,
        hidden: torch.Tensor,
        slots: torch.Tensor,
        flat_weights: torch.Tensor,
        top_k: int,
        host_slots: np.ndarray,
    ) -> torch.Tensor:
        """Every row with a slot through the grouped kernel (`host_slots`: `slots` on the host)."""
        gate_up, down, base = self.store.kernel_stack(layer)
        return grouped_rows(module, gate_up, down, hidden, slots, flat_weights, top_k, host_slots, base)

    def _expert_s(self, num_tokens: int, hidden: torch.Tensor, on_cpu: bool) -> float:
        """Predicted (modeled) seconds of one expert call from the profile's measured curve."""
        weight_bytes = self.num_expert_params * hidden.element_size()
        dtype = str(hidden.dtype).removeprefix("torch.")
        return self.profile.expert_s(num_tokens, weight_bytes, self.num_expert_params, on_cpu, dtype)

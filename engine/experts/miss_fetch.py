"""Fetching the experts a layer's misses need (the fetching half of
:class:`~fallbackgate.engine.experts.dispatch.ExpertDispatch`): `exact_load`s placed into slots with the layer's
experts pinned, `cpu_execute` and `expert_lowbit` rows computed on a one-slot stack, and disk reads queued ahead
for this layer's misses and the next layer's predicted experts."""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Iterable
from typing import Protocol

import numpy as np
import torch

from fallbackgate.engine.controller import Controller, ControllerView
from fallbackgate.engine.device_pool import Scratch
from fallbackgate.engine.experts.grouped import single_expert_rows
from fallbackgate.engine.experts.hook import ExpertUse, fetch_for_tag
from fallbackgate.engine.experts.lowbit_ahead import LowbitReadAhead
from fallbackgate.engine.experts.quarantine import ExpertQuarantined
from fallbackgate.engine.experts.routing import LayerRouting
from fallbackgate.engine.experts.served import LayerRows, group_by_key, record_fetched
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
    ) -> bool:
        """Free `num_bytes` of device room, never evicting `pinned_experts`; whether they are free now."""
        ...

    def ensure_room(self, num_bytes: int, what: str, *, is_kv_evictable: bool = True) -> None:
        """Free `num_bytes` of device room for `what`, or raise."""
        ...


class MissFetching:
    """Brings missed experts to where they compute, for :class:`~fallbackgate.engine.experts.dispatch.ExpertDispatch`
    (which calls its `_load_all`, `_run_single` and `_start_reads`)."""

    store: ExpertStore
    controller: Controller
    view: ControllerView
    profile: HardwareProfile
    host: RoomMaker
    routers: dict[int, torch.nn.Module]
    top_k: int
    ctx: StepContext  # ExpertDispatch.ctx: the current step
    _flush: Callable[..., None]  # ExpertDispatch._flush(module, layer, hidden, flat_weights, slots, out)
    _late_defer: Callable[..., None]  # ExpertDispatch._late_defer(uses, exc, flat_weights, late)
    _expert_s: Callable[..., float]  # ExpertDispatch._expert_s(num_tokens, hidden, on_cpu): modeled seconds
    lowbit_ahead: LowbitReadAhead  # the layer's persisted low-bit copies read ahead of their use

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
        self._room_for_all(by_key, pins)
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

    def _room_for_all(self, keys: Iterable[ExpertKey], pins: set[ExpertKey]) -> None:
        """Room for every expert of `keys` not on device, asked for once: the victims a request per load
        would take, in the same order (the loads are pinned and nothing else changes between them), from one
        walk of the controller's order instead of one per load. Where they do not all fit, the loads ask
        again one by one (and compute what is ready first)."""
        store = self.store
        num_missing = sum(1 for key in keys if not store.is_on_device(key))
        if num_missing > 1:
            num_bytes = num_missing * store.bytes_per_expert + store.place_bytes - store.bytes_per_expert
            self.host.make_room(num_bytes, pinned_experts=pins, is_kv_evictable=False)

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
        """cpu_execute or expert_lowbit: one expert's rows (the kernel's per-group matmul). It runs after the
        layer's exact rows are computed, so a low-bit copy's dequantization scratch may evict any expert in the
        controller's victim order; a read of its persisted copy queued ahead (`LowbitReadAhead`) is taken here
        and its buffer released. Pinning the layer's routed experts instead cost joint's low-bit
        admission bytes (stop 49: 1.307× Belady's MIN against 1.238× on 21 runs)."""
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
            self.lowbit_ahead.took(key)
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

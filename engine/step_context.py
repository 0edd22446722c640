"""Per-forward state shared by the experts hook and the paged cache, and the event accumulator."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from fallbackgate.engine.experts.routing import DIGEST_MASK
from fallbackgate.engine.hardware import HardwareProfile
from fallbackgate.engine.messages import Event, ExpertArrival, KVStaging, StepCapture
from fallbackgate.engine.tags import ObjectKind, Tag, Tier

_EventKey = tuple[str, int, ObjectKind, Tag, Tier | None, str, int, bool]


@dataclasses.dataclass(slots=True)
class ForwardBatch:
    """How one packed forward's tokens map onto requests."""

    request_ids: list[str]  # requests in packing order
    starts: list[int]  # position of each request's first token in this forward
    lengths: list[int]  # tokens of each request in this forward
    token_owner: torch.Tensor  # [T] index into request_ids for every packed token
    request_classes: list[str]  # class of each request


class EventLog:
    """Aggregates actions into one Event per step × request × layer × kind × tag (× source, note).

    Exact zero-byte uses need no event: a resident expert served as decided (no bytes, no note, no cost, outside
    a rebuild pass) and a KV block read where it lives on device are counts per request × layer
    (`expert_resident_uses`, `kv_resident_reads`), which the ledger keeps on the step's rows.
    """

    def __init__(self, step_id: int, started_s: float | None = None) -> None:
        self.step_id = step_id
        self.started_s = time.perf_counter() if started_s is None else started_s  # the step's start (perf_counter)
        self.kv_stagings: dict[tuple[str, int, int], KVStaging] = {}  # off-device blocks made usable, with when
        self.expert_arrivals: dict[tuple[str, int, int, Tag], ExpertArrival] = {}  # (request, layer, expert, tag)
        self._events: dict[_EventKey, Event] = {}
        self.modeled_transfer_s = 0.0  # serialised link time of this step
        self.modeled_compute_s = 0.0  # device + CPU compute time of this step
        self.is_rebuild_pass = False  # set by the runner around a KV rebuild forward
        self.kv_resident_reads: dict[str, dict[int, int]] = {}  # request -> layer -> device KV blocks read
        self.expert_resident_uses: dict[str, dict[int, int]] = {}  # request -> layer -> resident experts used
        self.routing_digests: dict[str, dict[int, int]] = {}  # request -> layer -> digest of its own forward's
        # routing (experts.routing.request_digests; a rebuild pass's is not kept)
        self.capture: StepCapture | None = None  # every access of the step, when a recorder asked for them
        self.failed: dict[str, str] = {}  # request -> why it cannot be served (a fault only it meets); it ends

    def fail(self, request_id: str, why: str) -> None:
        """Mark `request_id` failed this step (the first reason is kept): its output is discarded, it ends."""
        self.failed.setdefault(request_id, why)

    def add(
        self,
        request_id: str,
        layer: int,
        kind: ObjectKind,
        tag: Tag,
        *,
        count: int = 1,
        bytes_moved: int = 0,
        source_tier: Tier | None = None,
        predicted_cost: float = 0.0,
        modeled_s: float = 0.0,
        note: str = "",
        object_id: int | None = None,
        bits: int = 0,
    ) -> None:
        """Record `count` objects served with `tag` (`object_id`: which expert or block, kept for replay)."""
        if (
            tag is Tag.RESIDENT
            and kind is ObjectKind.EXPERT
            and not (bytes_moved or note or predicted_cost or modeled_s or self.is_rebuild_pass)
            and object_id is None
        ):
            self.add_expert_uses(request_id, layer, count)
            return
        key = (request_id, layer, kind, tag, source_tier, note, bits, self.is_rebuild_pass)
        event = self._events.get(key)
        if event is None:
            event = Event(
                self.step_id,
                request_id,
                layer,
                kind,
                tag,
                0,
                source_tier=source_tier,
                note=note,
                bits=bits,
                is_rebuild=self.is_rebuild_pass,
            )
            self._events[key] = event
        if object_id is not None:
            event.object_ids.append(object_id)
        event.count += count
        event.bytes_moved += bytes_moved
        event.predicted_cost += predicted_cost
        event.modeled_s += modeled_s

    def add_transfer(
        self,
        profile: HardwareProfile,
        request_id: str,
        layer: int,
        kind: ObjectKind,
        tag: Tag,
        bytes_moved: int,
        source_tier: Tier | None,
        *,
        predicted_cost: float = 0.0,
        note: str = "",
        object_id: int | None = None,
        bits: int = 0,
    ) -> None:
        """Record an action that moved `bytes_moved` from `source_tier`, charging its link time to the step."""
        modeled = profile.transfer_s(bytes_moved, source_tier) if source_tier is not None else 0.0
        self.modeled_transfer_s += modeled
        self.add(
            request_id,
            layer,
            kind,
            tag,
            bytes_moved=bytes_moved,
            source_tier=source_tier,
            predicted_cost=predicted_cost,
            modeled_s=modeled,
            note=note,
            object_id=object_id,
            bits=bits,
        )

    def add_staging(self, key: tuple[str, int, int], tag: Tag, bytes_moved: int) -> None:
        """Note that KV block `key` is usable now (served with `tag`)."""
        ready = time.perf_counter() - self.started_s
        self.kv_stagings[key] = KVStaging(key[0], key[1], key[2], tag, bytes_moved, ready)

    def add_expert_arrival(
        self, request_ids: Sequence[str], key: tuple[int, int], tag: Tag, bytes_moved: int, read_end_ns: int
    ) -> None:
        """Note that expert `key`, fetched for `request_ids`, is usable: when its last disk read ended
        (`read_end_ns`, monotonic ns), or now when nothing was read. A request's first fetch of it with `tag`
        in the step counts (a rebuild pass may load what the step's own forward then defers)."""
        now = time.perf_counter()
        ready_at = now - (time.monotonic_ns() - read_end_ns) / 1e9 if read_end_ns else now
        for request_id in request_ids:
            arrival = ExpertArrival(request_id, key[0], key[1], tag, bytes_moved, ready_at - self.started_s)
            self.expert_arrivals.setdefault((request_id, key[0], key[1], tag), arrival)

    def mark_rebuilt(self, request_id: str) -> None:
        """The request's rebuild pass ended: its blocks staged for recompute are usable now."""
        ready = time.perf_counter() - self.started_s
        for key, staging in list(self.kv_stagings.items()):
            if key[0] == request_id and staging.tag is Tag.RECOMPUTE:
                self.kv_stagings[key] = dataclasses.replace(staging, ready_s=ready)

    def add_kv_reads(self, request_id: str, layer: int, count: int) -> None:
        """Record `count` KV blocks read where they live on device (counted, not one event each)."""
        by_layer = self.kv_resident_reads.setdefault(request_id, {})
        by_layer[layer] = by_layer.get(layer, 0) + count

    def add_expert_uses(self, request_id: str, layer: int, count: int) -> None:
        """Record `count` experts used where they live on device, as decided (counted, not one event each)."""
        by_layer = self.expert_resident_uses.setdefault(request_id, {})
        by_layer[layer] = by_layer.get(layer, 0) + count

    def add_routing(self, request_id: str, layer: int, digest: int) -> None:
        """Fold one forward's routing digest of `request_id` at `layer` into the step's (sums modulo 2**64)."""
        by_layer = self.routing_digests.setdefault(request_id, {})
        by_layer[layer] = (by_layer.get(layer, 0) + digest) & DIGEST_MASK

    def events(self) -> list[Event]:
        return list(self._events.values())


MEASURED_DECAY = 0.3  # weight of the newest decode step in StepUses.measured_compute_s


@dataclasses.dataclass(slots=True)
class StepUses:
    """What a step used, in use order, for the controller's view of it; the executor clears it at step end."""

    used_expert_keys: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # experts computed
    used_kv_block_keys: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)  # off-device reads
    deferred_expert_keys: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # loads queued
    measured_compute_s: float = 0.0  # decaying mean of decode steps' wall time less their exposed disk reads
    # (kept across steps; 0.0 until a decode step ran)

    def note_decode_step(self, wall_s: float, exposed_read_s: float) -> None:
        """Fold one decode step's measured compute time (wall clock less the disk reads it waited for) into
        :attr:`measured_compute_s`."""
        compute_s = max(0.0, wall_s - exposed_read_s)
        previous = self.measured_compute_s
        self.measured_compute_s = compute_s if previous == 0.0 else previous + MEASURED_DECAY * (compute_s - previous)

    def clear(self) -> None:
        self.used_expert_keys.clear()
        self.used_kv_block_keys.clear()
        self.deferred_expert_keys.clear()


class ReplayHooks(Protocol):
    """What a replay pass (the audit's recomputation of a served request) supplies instead of the stores."""

    def experts(
        self,
        module: torch.nn.Module,
        layer: int,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """The routed experts' output for the forward's tokens."""
        ...

    def attend(
        self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        """Attention output [1, T, H, Dv] of the forward's queries over the K/V its cache returned."""
        ...


@dataclasses.dataclass(slots=True)
class StepContext:
    """Everything a forward's hooks need; set by the runner around each forward pass."""

    step_id: int  # engine step
    batch: ForwardBatch  # token -> request mapping
    log: EventLog  # where actions are recorded
    is_observe: bool = False  # decide and record, but serve exact
    is_exact_baseline: bool = False  # audit pass: exact weights, nothing recorded
    replay: ReplayHooks | None = None  # audit replay pass: experts and attention come from the replay
    used_expert_keys: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    deferred_expert_keys: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    token_owner: list[int] = dataclasses.field(default_factory=list)  # batch.token_owner as a list
    row_owner: np.ndarray | None = None  # request index of each (token, top-k) row (set by the first MoE layer)

    def __post_init__(self) -> None:
        self.token_owner = self.batch.token_owner.tolist()


def log_rebuilt(log: EventLog, request_id: str, start: int, end: int, block_size: int, num_layers: int) -> None:
    """Record positions start..end re-filled by a re-prefill after a drop preemption: their blocks are
    `recompute`, not prefill."""
    if end <= start:
        return
    num_blocks = (end - 1) // block_size - start // block_size + 1
    for layer in range(num_layers):
        log.add(
            request_id,
            layer,
            ObjectKind.KV_BLOCK,
            Tag.RECOMPUTE,
            count=num_blocks,
            note="re-prefill after drop preemption",
        )

"""Where the joint controller's device bytes go (the memory half of
:class:`~fallbackgate.controllers.joint.JointController`): the copy a KV block leaves behind when it is spilled,
the victims to free room, lowest value per byte first, and the step-end rebalancing
(:func:`~fallbackgate.controllers.joint_memory.rebalance`)."""

from __future__ import annotations

import heapq
from collections.abc import Container, Iterator
from typing import TypeVar

from fallbackgate.controllers.base import Recency
from fallbackgate.controllers.expert_rank import ExpertRanking
from fallbackgate.controllers.joint_memory import demotions, rebalance
from fallbackgate.controllers.link import LinkBudget
from fallbackgate.controllers.values import ValueModel
from fallbackgate.engine.controller import ControllerView, ExpertMiss, StepEndActions, Victim
from fallbackgate.engine.device_pool import HeldCopy
from fallbackgate.engine.experts.store import ExpertKey
from fallbackgate.engine.kv.block import RequestBlockKeys
from fallbackgate.engine.kv.prefix_types import PrefixEntryInfo
from fallbackgate.engine.kv.store import KVBlockKey, SpillMode
from fallbackgate.engine.tags import ObjectKind, Tag, Tier
from fallbackgate.policy.budgets import BudgetBook

T = TypeVar("T")
DROP_BELOW_REUSE = 0.5  # adoptions per kept prefix block below which an unadopted one leaves without a copy


def prefix_spill_mode(entry: PrefixEntryInfo) -> SpillMode:
    """A kept prefix block leaving the fast tier keeps a copy (read back exactly if adopted), unless it was
    never adopted in a run where most kept blocks are not (`DROP_BELOW_REUSE`): then writing it would most
    likely be wasted, and an adopter that misses it computes its prefill. A session's block always keeps one:
    its next turn is declared, and the run's share judges a conversation before its second turns arrive."""
    if entry.num_hits == 0 and entry.reuse_share < DROP_BELOW_REUSE and not entry.is_session:
        return SpillMode.DROP
    return SpillMode.HOST_FULL


def _drain(heap: list[T]) -> Iterator[T]:
    """Pop a heap's items smallest first, as they are asked for."""
    while heap:
        yield heapq.heappop(heap)


class JointPlacement:
    """Spill modes, victims and step-end actions of :class:`~fallbackgate.controllers.joint.JointController`."""

    book: BudgetBook
    values: ValueModel
    recency: Recency
    ranking: ExpertRanking  # device experts in victim order, kept between misses and steps
    loading: set[ExpertKey]  # experts whose exact load this step booked
    current_layer: int  # the layer the step is at (its last expert miss; -1 before the first)
    link: LinkBudget
    kv_bits: int
    top_k: int
    is_observe: bool

    def spill_mode(self, request_id: str, view: ControllerView) -> SpillMode:
        """A quantized copy only for classes that may read one and rebuild exactly when their budget is spent.
        On a CPU the copies go to the disk alone (RAM is the fast tier), where an exact read of a
        quantized-only block would be a recompute whose tokens run through experts that mostly miss: there a
        class that may read a quantized copy gets both copies (the reader chooses), any other a full one."""
        budget = self.book.requests.get(request_id)
        if budget is None or self.is_observe:
            return SpillMode.HOST_FULL
        tags = budget.limits.allowed_tags
        if view.is_ram_tiered:
            is_both = Tag.KV_DEQUANT.value in tags and not budget.is_spent
            return SpillMode.DISK_FULL_AND_INT8 if is_both else SpillMode.DISK_FULL
        if Tag.KV_DEQUANT.value in tags and Tag.RECOMPUTE.value in tags and not budget.is_spent:
            return SpillMode.HOST_INT8 if self.kv_bits == 8 else SpillMode.HOST_INT4
        return SpillMode.HOST_FULL

    def choose_victims(
        self,
        num_bytes: int,
        view: ControllerView,
        pinned_experts: Container[ExpertKey],
        pinned_kv: Container[KVBlockKey],
    ) -> Iterator[Victim]:
        """Everything on device, produced lazily: experts in the ranking's order (lowest value per byte per
        expected step to their next use at the layer the step is at: the farthest cold use first; synced with
        what changed since the last call, read without popping), KV blocks lowest value per byte first,
        request by request (a request's blocks share one value) in the order of a heap of request values; the
        two streams merged by value per byte (ties: the expert first). k victims cost
        O(c log E + G + R log R + k log E) for c experts changed since the last call, E device experts in G
        (layer, home) groups and R requests, whatever the KV length."""
        self.ranking.sync(view, self.values)
        ranked_experts = (
            (value, Victim(expert_key=key))
            for value, key in self.ranking.victims(view, self.values, pinned_experts, self.current_layer)
        )
        ranked_kv = self._kv_victims(view, pinned_kv)
        return (victim for _, victim in heapq.merge(ranked_experts, ranked_kv, key=lambda item: item[0]))

    def is_colder_than_victim(self, miss: ExpertMiss, view: ControllerView) -> bool:
        """Whether `miss`'s expert is expected back later than the first expert its exact copy would evict:
        both by urgency at the miss's layer (:meth:`~fallbackgate.controllers.values.ValueModel.expert_urgency`),
        the layer's routed experts pinned as the engine pins them (a load in the forward evicts experts only).
        False when it fits without evicting, or nothing could go."""
        key = (miss.layer, miss.expert_id)
        booked = sum(1 for k in self.loading if k[0] == miss.layer and not view.is_expert_on_device(k))
        free = view.device_free_bytes  # kept low-bit copies go before any expert when room is made (CPU)
        free += view.device_used_bytes(HeldCopy.EXPERT_LOWBIT) if view.is_ram_tiered else 0
        if free >= (booked + 1) * view.bytes_per_expert:
            return False
        pinned = {(miss.layer, e) for e in miss.layer_expert_ids} | {key}
        self.ranking.sync(view, self.values)
        victim = next((k for _, k in self.ranking.victims(view, self.values, pinned, miss.layer)), None)
        urgency = self.values.expert_urgency
        return victim is not None and urgency(key, view, miss.layer) < urgency(victim, view, miss.layer)

    def _kv_victims(self, view: ControllerView, pinned_kv: Container[KVBlockKey]) -> Iterator[tuple[float, Victim]]:
        """Device KV blocks by value, requests in value order (ties in the view's order), each one's blocks
        walked lazily; a request pinned whole (a :class:`RequestBlockKeys` request) is not walked at all, a
        kept prefix with no layer on device (already spilled) is not valued."""
        running = set(view.running_ids)
        whole = pinned_kv.request_ids if isinstance(pinned_kv, RequestBlockKeys) else frozenset()
        quant_fraction = None  # a quantized copy's share of a block's bytes, asked for once when needed
        requests = []
        for i, rid in enumerate(view.kv_request_ids):
            if rid in whole:  # every block pinned: nothing to walk
                continue
            entry = view.prefix_entry(rid)
            if entry is not None:  # a kept prefix: goes to disk, still reusable, when colder than what stays
                if entry.num_on_device:
                    requests.append((self.values.prefix_value(entry, view), i, rid, prefix_spill_mode(entry)))
                continue
            mode = self.spill_mode(rid, view)
            if mode is not SpillMode.HOST_FULL and quant_fraction is None:
                quant_bytes = view.quantized_bytes(ObjectKind.KV_BLOCK, self.kv_bits)
                quant_fraction = quant_bytes / max(1, view.bytes_per_kv_block)
            fraction = 1.0 if mode is SpillMode.HOST_FULL else quant_fraction
            requests.append((self.values.kv_value((rid, 0, 0), view, running, fraction), i, rid, mode))
        heapq.heapify(requests)
        for value, _, rid, mode in _drain(requests):
            for block in view.device_kv_blocks_of(rid):
                if block.key not in pinned_kv:
                    yield value, Victim(kv_block_key=block.key, spill_mode=mode)

    def on_step_end(self, view: ControllerView) -> StepEndActions:
        """Update the values and the ranking with the step's uses, rebalance into the host link time left, and
        give the experts the step lost their room back from colder KV (:func:`demotions`)."""
        self.current_layer = -1  # what moves now competes for the next step, which starts at the first layer
        self.values.update(view)
        self.recency.touch(view)
        self.ranking.sync(view, self.values)
        actions = rebalance(view, self.values, self.link.left_s.get(Tier.HOST, 0.0), self.top_k, self.ranking)
        demotions(view, self.values, self._kv_victims(view, ()), actions)
        return actions

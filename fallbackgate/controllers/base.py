"""Shared pieces of the policy-driven controllers: recency tracking, KV ordering, step-end basics."""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Container, Iterable, Iterator

from fallbackgate.controllers.expert_recency import ExpertRecency
from fallbackgate.controllers.kv_order import KVOrder
from fallbackgate.controllers.link import LinkBudget
from fallbackgate.controllers.timing import cpu_expert_s, step_deadline_s
from fallbackgate.engine.controller import (
    Controller,
    ControllerView,
    Decision,
    ExpertMiss,
    KVBlockInfo,
    KVMiss,
    StepEndActions,
    Victim,
)
from fallbackgate.engine.experts.store import ExpertKey
from fallbackgate.engine.hardware import CPU_BOX
from fallbackgate.engine.kv.block import RequestBlockKeys
from fallbackgate.engine.kv.store import KVBlockKey, SpillMode
from fallbackgate.engine.messages import StepPlan
from fallbackgate.engine.tags import Tag
from fallbackgate.policy.schema import Policy


class Recency:
    """Least-recently-used order of expert keys and KV block keys, updated at every step end."""

    def __init__(self) -> None:
        self.experts: OrderedDict[ExpertKey, None] = OrderedDict()
        self.kv: OrderedDict[KVBlockKey, None] = OrderedDict()
        self._kv_rank: dict[KVBlockKey, int] | None = None  # position in `kv`, until the next touch
        self._kv_order = KVOrder()  # the KV order kept from a view's residency journal, until the next touch
        self._expert_order = ExpertRecency()  # the expert order kept from a view's residency journal

    def touch(self, view: ControllerView) -> None:
        """Move the last step's used experts and KV blocks to the most recent end."""
        for key in view.used_expert_keys:
            self.experts.pop(key, None)
            self.experts[key] = None
        self._expert_order.touch(view.used_expert_keys)
        for key in view.used_kv_block_keys:
            self.kv.pop(key, None)
            self.kv[key] = None
        self._kv_rank = None
        self._kv_order.invalidate()

    def experts_lru_first(self, view: ControllerView) -> Iterator[ExpertKey]:
        """Device experts, least recently used first (never-used ones first of all, in the store's order),
        produced lazily; O(log n) per expert taken where the view keeps a residency journal."""
        kept = self._expert_order.lru_first(view)
        if kept is not None:
            yield from kept
            return
        on_device = view.device_expert_keys()
        yield from (k for k in on_device if k not in self.experts)
        resident = set(on_device)
        yield from (k for k in self.experts if k in resident)

    def kv_lru_first(self, view: ControllerView) -> Iterator[KVBlockKey]:
        """Device KV blocks: blocks of requests not running first, then older blocks first — never-read
        blocks by (index, layer, request order), then read ones by when they were last read — produced
        lazily: a request's blocks are walked only as far as they are taken. A view with a KV residency
        journal (``kv_changes_since``) gets the same order from :class:`KVOrder`, patched per change (at this
        call, not at the first block taken)."""
        if self._kv_rank is None:
            self._kv_rank = {k: i for i, k in enumerate(self.kv)}
        kept = self._kv_order.ordered(view, self._kv_rank)
        return kept if kept is not None else self._kv_walk(view)

    def kv_lru_unpinned(self, view: ControllerView, pinned_kv: Container[KVBlockKey]) -> Iterator[KVBlockKey]:
        """`kv_lru_first` without the blocks in `pinned_kv`; nothing is walked when every request is pinned
        whole (an expert miss, where KV may not go: a walk there cost O(KV blocks) per miss)."""
        if isinstance(pinned_kv, RequestBlockKeys) and pinned_kv.request_ids.issuperset(view.kv_request_ids):
            return iter(())
        return itertools.filterfalse(pinned_kv.__contains__, self.kv_lru_first(view))  # pinned: skipped in C

    def _kv_walk(self, view: ControllerView) -> Iterator[KVBlockKey]:
        """`kv_lru_first` for a view without a journal: each request's blocks walked as far as taken."""
        assert self._kv_rank is not None
        running = set(view.running_ids)
        rids = view.kv_request_ids
        for group in ([r for r in rids if r not in running], [r for r in rids if r in running]):
            read: list[KVBlockKey] = []  # device blocks of the group read before, met during the walks
            walks = [self._never_read(view.device_kv_blocks_of(rid, is_index_major=True), read) for rid in group]
            yield from heapq.merge(*walks, key=lambda key: (key[2], key[1]))  # ties keep request order
            if read:  # every walk is finished: `read` holds all of them
                yield from sorted(read, key=self._kv_rank.__getitem__)

    def _never_read(self, walk: Iterator[KVBlockInfo], read: list[KVBlockKey]) -> Iterator[KVBlockKey]:
        """The keys of `walk` never read, in order; the others are put in `read`."""
        for block in walk:
            if block.key in self.kv:
                read.append(block.key)
            else:
                yield block.key


def take_victims(
    candidates: Iterable[Victim],
    view: ControllerView,
    pinned_experts: Container[ExpertKey],
    pinned_kv: Container[KVBlockKey],
) -> Iterator[Victim]:
    """The candidates in order without pinned objects, lazily. The engine takes victims in order only until
    enough is free, and skips KV victims when only experts may go."""
    return (
        v
        for v in candidates
        if (v.expert_key is not None and v.expert_key not in pinned_experts)
        or (v.kv_block_key is not None and v.kv_block_key not in pinned_kv)
    )


def full_block_keys(view: ControllerView) -> set[KVBlockKey]:
    """Device KV blocks that are full and not the tail a request still writes."""
    size = view.block_size
    return {
        b.key
        for b in view.device_kv_blocks()
        if b.num_tokens == size and b.key[2] < view.num_kv_tokens(b.key[0]) // size
    }


class ExactBaseline(Controller):
    """Exact decisions shared by the baselines: load every miss at full precision.

    With a `policy` and `is_equivalent_allowed`, a miss whose load cannot arrive before the step's deadline
    runs on the CPU instead (``cpu_execute``: the same math) when its class allows that tag and the measured
    profile predicts it faster, the step's CPU experts adding up as the joint controller counts them: the
    same equivalent tags joint may use, so a comparison isolates placement."""

    def __init__(self, policy: Policy | None = None, is_equivalent_allowed: bool = False) -> None:
        self.recency = Recency()
        self.policy = policy
        self.is_equivalent_allowed = is_equivalent_allowed and policy is not None
        self.link = LinkBudget(CPU_BOX)
        self.cpu_left_s = 0.0

    @property
    def reads_profile(self) -> bool:
        """Only the equivalent-tag deadline check reads the profile; exact-only decisions never do."""
        return self.is_equivalent_allowed

    def on_step_start(self, plan: StepPlan, view: ControllerView) -> None:
        if self.is_equivalent_allowed and self.policy is not None:
            self.link.profile = view.profile
            deadline = step_deadline_s(self.policy, plan, view)
            self.link.reset(deadline, view.io_snapshot(), view.is_ram_tiered)
            self.cpu_left_s = deadline

    def expert_action(self, miss: ExpertMiss) -> Decision:
        if not self.is_equivalent_allowed or self.policy is None:
            return Decision(Tag.EXACT_LOAD)
        if self.link.fits(miss.num_bytes, miss.home):
            self.link.take(miss.num_bytes, miss.home)
            return Decision(Tag.EXACT_LOAD)
        cls = self.policy.classes.get(miss.request_class)
        cpu_s = cpu_expert_s(self.link.profile, miss)
        is_allowed = cls is not None and Tag.CPU_EXECUTE.value in cls.budget.allowed_tags
        is_allowed = is_allowed and miss.is_cpu_execute_offered
        if is_allowed and cpu_s < sum(self.link.legs(miss.num_bytes, miss.home).values()) and cpu_s <= self.cpu_left_s:
            self.cpu_left_s -= cpu_s
            return Decision(Tag.CPU_EXECUTE, reason="deadline: same math on the CPU")
        self.link.take(miss.num_bytes, miss.home)
        return Decision(Tag.EXACT_LOAD)

    def kv_action(self, miss: KVMiss) -> Decision:
        if miss.exact_tier is not None:
            return Decision(Tag.EXACT_LOAD)
        return Decision(Tag.RECOMPUTE, reason="no full-precision copy")

    def kv_fault_action(self, miss: KVMiss, fault: str) -> Decision | None:
        """An unreadable KV copy: rebuilt when there is no policy, or the request's class allows recompute."""
        cls = self.policy.classes.get(miss.request_class) if self.policy is not None else None
        if self.policy is not None and (cls is None or Tag.RECOMPUTE.value not in cls.budget.allowed_tags):
            return None
        return Decision(Tag.RECOMPUTE, reason=f"{fault}; rebuilt by recompute")

    def on_step_end(self, view: ControllerView) -> StepEndActions:
        """Promote the KV blocks read this step when they fit; prefetch nothing."""
        self.recency.touch(view)
        return StepEndActions(promote_kv=list(view.used_kv_block_keys))

    def kv_victim(self, key: KVBlockKey) -> Victim:
        return Victim(kv_block_key=key, spill_mode=SpillMode.HOST_FULL)

"""Static split baseline: a fixed share of the device budget for expert slots, the rest for KV; LRU in each."""

from __future__ import annotations

import itertools
from collections.abc import Container, Iterator

from fallbackgate.controllers.base import ExactBaseline, take_victims
from fallbackgate.controllers.registry import ControllerKind, register_controller
from fallbackgate.engine.controller import ControllerView, StepEndActions, Victim
from fallbackgate.engine.experts.store import ExpertKey
from fallbackgate.engine.kv.store import KVBlockKey
from fallbackgate.engine.tags import ObjectKind
from fallbackgate.policy.schema import Policy


@register_controller(
    ControllerKind.STATIC_SPLIT, lambda cls, policy, o: cls(o.expert_fraction, policy, o.is_equivalent_allowed)
)
class StaticSplitController(ExactBaseline):
    """Exact-only; experts may hold at most `expert_fraction` of the device budget, KV the rest.

    Experts above their share are evicted first when anything needs room and at every step end; KV
    blocks above the KV share go next (LRU, requests not running first); then the LRU of either side.
    """

    def __init__(
        self, expert_fraction: float = 0.5, policy: Policy | None = None, is_equivalent_allowed: bool = False
    ) -> None:
        super().__init__(policy, is_equivalent_allowed)
        if not 0.0 < expert_fraction < 1.0:
            raise ValueError(f"expert_fraction must be in (0, 1), got {expert_fraction}")
        self.expert_fraction = expert_fraction

    def _shares(self, view: ControllerView) -> tuple[int, int]:
        budget = view.device_budget_bytes
        expert_share = int(budget * self.expert_fraction)
        return expert_share, budget - expert_share

    def choose_victims(
        self,
        num_bytes: int,
        view: ControllerView,
        pinned_experts: Container[ExpertKey],
        pinned_kv: Container[KVBlockKey],
    ) -> Iterator[Victim]:
        expert_share, kv_share = self._shares(view)
        experts = (k for k in self.recency.experts_lru_first(view) if k not in pinned_experts)
        blocks = self.recency.kv_lru_unpinned(view, pinned_kv)
        per_expert, per_block = view.bytes_per_expert, view.bytes_per_kv_block
        over_e = max(0, -(-(view.device_used_bytes(ObjectKind.EXPERT) - expert_share) // per_expert))
        over_kv = max(0, -(-(view.device_used_bytes(ObjectKind.KV_BLOCK) - kv_share) // per_block))
        ordered = itertools.chain(  # each side's share overflow first, then the rest of each, all lazily
            (Victim(expert_key=k) for k in itertools.islice(experts, over_e)),
            (self.kv_victim(k) for k in itertools.islice(blocks, over_kv)),
            (Victim(expert_key=k) for k in experts),
            (self.kv_victim(k) for k in blocks),
        )
        return take_victims(ordered, view, pinned_experts, pinned_kv)

    def on_step_end(self, view: ControllerView) -> StepEndActions:
        actions = super().on_step_end(view)
        expert_share, _ = self._shares(view)
        used = view.device_used_bytes(ObjectKind.EXPERT)
        for key in self.recency.experts_lru_first(view):
            if used <= expert_share:
                break
            actions.evict_experts.append(key)
            used -= view.bytes_per_expert
        return actions

"""Two independent LRU caches over one device budget: each side evicts its own least recently used objects."""

from __future__ import annotations

import itertools
from collections.abc import Container, Iterator

from fallbackgate.controllers.base import ExactBaseline, take_victims
from fallbackgate.controllers.registry import ControllerKind, register_controller
from fallbackgate.engine.controller import ControllerView, Victim
from fallbackgate.engine.experts.store import ExpertKey
from fallbackgate.engine.kv.store import KVBlockKey


@register_controller(ControllerKind.INDEPENDENT_LRU, lambda cls, policy, o: cls(policy, o.is_equivalent_allowed))
class IndependentLRUController(ExactBaseline):
    """Exact-only. KV growth evicts the LRU KV blocks (requests not running first) before touching experts;
    expert loads evict the LRU experts. No value comparison between the two sides."""

    def choose_victims(
        self,
        num_bytes: int,
        view: ControllerView,
        pinned_experts: Container[ExpertKey],
        pinned_kv: Container[KVBlockKey],
    ) -> Iterator[Victim]:
        ordered = itertools.chain(
            map(self.kv_victim, self.recency.kv_lru_unpinned(view, pinned_kv)),
            (Victim(expert_key=k) for k in self.recency.experts_lru_first(view)),
        )
        return take_victims(ordered, view, pinned_experts, pinned_kv)

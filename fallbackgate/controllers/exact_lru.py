"""The exact-only LRU controller (mixtral-offloading style), with optional forced tags for testing."""

from __future__ import annotations

import itertools
from collections.abc import Container, Iterable, Iterator

from fallbackgate.controllers.base import Recency, full_block_keys, take_victims
from fallbackgate.controllers.registry import ControllerKind, register_controller
from fallbackgate.engine.controller import (
    Controller,
    ControllerView,
    Decision,
    ExpertMiss,
    KVMiss,
    StepEndActions,
    Victim,
)
from fallbackgate.engine.experts.store import ExpertKey
from fallbackgate.engine.kv.store import KVBlockKey, SpillMode
from fallbackgate.engine.tags import Tag

FORCEABLE_TAGS = frozenset({Tag.CPU_EXECUTE, Tag.EXPERT_DEFER, Tag.EXPERT_LOWBIT, Tag.KV_DEQUANT, Tag.RECOMPUTE})


@register_controller(
    ControllerKind.EXACT_LRU, lambda cls, policy, o: cls(kv_quant_bits=policy.controller.kv_quant_bits)
)
class ExactLRUController(Controller):
    """Loads every miss exactly; evicts the least recently used expert, then the oldest KV block.

    `force` turns fallback tags on for testing: expert tags apply to every expert miss, and forcing
    `kv_dequant` / `recompute` spills every full KV block after each step to a quantized copy / to nothing.
    """

    def __init__(self, force: Iterable[Tag | str] = (), kv_quant_bits: int = 8) -> None:
        self.force = {Tag(t) for t in force}
        unknown = self.force - FORCEABLE_TAGS
        if unknown:
            raise ValueError(
                f"cannot force {sorted(t.value for t in unknown)}; forceable: {sorted(t.value for t in FORCEABLE_TAGS)}"
            )
        self.kv_spill_mode = SpillMode.HOST_FULL
        if Tag.KV_DEQUANT in self.force:
            self.kv_spill_mode = SpillMode.HOST_INT8 if kv_quant_bits == 8 else SpillMode.HOST_INT4
        if Tag.RECOMPUTE in self.force:
            self.kv_spill_mode = SpillMode.DROP
        self.recency = Recency()

    @property
    def reads_profile(self) -> bool:
        return False  # every decision is fixed by the forced tags and recency

    def expert_action(self, miss: ExpertMiss) -> Decision:
        if Tag.EXPERT_DEFER in self.force:
            return Decision(Tag.EXPERT_DEFER, reason="forced")
        if Tag.EXPERT_LOWBIT in self.force and miss.is_lowbit_available:
            return Decision(Tag.EXPERT_LOWBIT, reason="forced")
        if Tag.CPU_EXECUTE in self.force:
            return Decision(Tag.CPU_EXECUTE, reason="forced")
        return Decision(Tag.EXACT_LOAD)

    def kv_action(self, miss: KVMiss) -> Decision:
        if Tag.RECOMPUTE in self.force or (miss.exact_tier is None and miss.quant_tier is None):
            return Decision(Tag.RECOMPUTE, reason="forced" if Tag.RECOMPUTE in self.force else "no copy")
        if Tag.KV_DEQUANT in self.force and miss.quant_tier is not None:
            return Decision(Tag.KV_DEQUANT, reason="forced")
        if miss.exact_tier is not None:
            return Decision(Tag.EXACT_LOAD)
        return Decision(Tag.RECOMPUTE, reason="only a quantized copy exists; exact-only policy rebuilds")

    def choose_victims(
        self,
        num_bytes: int,
        view: ControllerView,
        pinned_experts: Container[ExpertKey],
        pinned_kv: Container[KVBlockKey],
    ) -> Iterator[Victim]:
        experts = (Victim(expert_key=k) for k in self.recency.experts_lru_first(view))
        mode = self.kv_spill_mode
        kv = self.recency.kv_lru_unpinned(view, pinned_kv)
        blocks = (Victim(kv_block_key=k, spill_mode=mode) for k in kv)
        return take_victims(itertools.chain(experts, blocks), view, pinned_experts, pinned_kv)

    def on_step_end(self, view: ControllerView) -> StepEndActions:
        self.recency.touch(view)
        actions = StepEndActions(load_experts=list(dict.fromkeys(view.deferred_expert_keys)))
        if Tag.KV_DEQUANT in self.force or Tag.RECOMPUTE in self.force:
            actions.spill = [(key, self.kv_spill_mode) for key in sorted(full_block_keys(view))]
        else:
            actions.promote_kv = list(view.used_kv_block_keys)
        return actions

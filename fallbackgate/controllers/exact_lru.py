"""The exact-only LRU controller (mixtral-offloading style), with optional forced tags for testing."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from engine.controller import Controller, Decision, EngineView, ExpertMiss, KVMiss, StepEndActions, Victim
from engine.expert_store import ExpertKey
from engine.kv_store import KVBlockKey, SpillMode
from engine.tags import Tag

FORCEABLE_TAGS = frozenset({Tag.CPU_EXECUTE, Tag.EXPERT_DEFER, Tag.EXPERT_LOWBIT, Tag.KV_DEQUANT, Tag.RECOMPUTE})


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
        self.expert_lru: OrderedDict[ExpertKey, None] = OrderedDict()

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
        self, num_bytes: int, view: EngineView, pinned_experts: set[ExpertKey], pinned_kv: set[KVBlockKey]
    ) -> list[Victim]:
        victims: list[Victim] = []
        freed = 0
        on_device = set(view.expert_store.device_keys())
        ordered = [k for k in self.expert_lru if k in on_device] + [k for k in on_device if k not in self.expert_lru]
        for key in ordered:
            if freed >= num_bytes:
                return victims
            if key not in pinned_experts:
                victims.append(Victim(expert_key=key))
                freed += view.expert_store.bytes_per_expert
        running = set(view.running_ids)
        blocks = sorted(view.kv_store.device_blocks(), key=lambda b: (b.key[0] in running, b.key[2], b.key[1]))
        for block in blocks:
            if freed >= num_bytes:
                break
            if block.key not in pinned_kv:
                victims.append(Victim(kv_block_key=block.key, spill_mode=self.kv_spill_mode))
                freed += view.kv_store.bytes_per_block
        return victims

    def on_step_end(self, view: EngineView) -> StepEndActions:
        for key in view.used_expert_keys:
            self.expert_lru.pop(key, None)
            self.expert_lru[key] = None
        actions = StepEndActions(load_experts=list(dict.fromkeys(view.deferred_expert_keys)))
        if Tag.KV_DEQUANT in self.force or Tag.RECOMPUTE in self.force:
            kv = view.kv_store
            for block in kv.device_blocks():
                if block.num_tokens == kv.block_size and block.key[2] < kv.num_tokens[block.key[0]] // kv.block_size:
                    actions.spill.append((block.key, self.kv_spill_mode))
        else:
            actions.promote_kv = list(view.used_kv_block_keys)
        return actions

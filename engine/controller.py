"""The small interface the engine consults each step. Controllers (in `fallbackgate`) implement it.

The engine reports what is possible and what it costs; a controller decides. Controllers read the engine's
state only through a :class:`ControllerView` (`engine/controller_view.py`), and answer with the messages
here: a :class:`Decision` per miss, :class:`Victim` s to make room, :class:`StepEndActions` at a step's end.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Container, Iterable

from fallbackgate.engine.controller_view import ControllerView, KVBlockInfo
from fallbackgate.engine.experts.sources import ExpertKey
from fallbackgate.engine.kv.block import KVBlockKey, SpillMode
from fallbackgate.engine.messages import StepPlan
from fallbackgate.engine.tags import Tag, Tier

__all__ = [  # the view's types come from engine/controller_view.py; controllers import both from here
    "Controller",
    "ControllerView",
    "Decision",
    "ExpertMiss",
    "KVBlockInfo",
    "KVMiss",
    "StepEndActions",
    "Victim",
]


@dataclasses.dataclass(slots=True)
class ExpertMiss:
    """A routed expert that one request's tokens need and that is not on device."""

    step_id: int  # current step
    request_id: str  # request whose tokens route to the expert
    request_class: str  # its policy class
    layer: int  # decoder layer
    expert_id: int  # routed expert index
    num_tokens: int  # tokens of this request routed to the expert in this step
    max_gate_weight: float  # largest routing weight among those tokens (proxy for defer cost)
    home: Tier  # where the full-precision copy lives
    num_bytes: int  # full-precision bytes of the expert
    is_lowbit_available: bool  # an int8/int4 copy exists or can be made (see `lowbit_disk_bytes`)
    is_device_room: bool  # the expert fits on device without evicting anything
    dtype: str = ""  # compute dtype of the expert's weights ("bfloat16", ...), for its measured compute time
    is_cpu_execute_offered: bool = True  # False where the device is the CPU: RAM is the one fast tier
    lowbit_disk_bytes: int = 0  # bytes the low-bit copy must first read from disk: 0 kept (or made from a
    # resident or host copy), a low-bit copy's when persisted, the whole expert when made from the checkpoint
    layer_expert_ids: tuple[int, ...] = ()  # every expert the layer routes in this forward (the engine pins them
    # while it makes room for a load)


@dataclasses.dataclass(slots=True)
class KVMiss:
    """A KV block a request must read this step that is not on device."""

    step_id: int  # current step
    request_id: str  # owner
    request_class: str  # its policy class
    layer: int  # decoder layer
    block_index: int  # index in the request's block table
    exact_tier: Tier | None  # tier of the nearest full-precision copy, None when none exists
    quant_tier: Tier | None  # tier of the nearest quantized copy, None when none exists
    quant_bits: int  # bits of that quantized copy (0 when none)
    num_bytes: int  # full-precision bytes of the block


@dataclasses.dataclass(slots=True)
class Decision:
    """A controller's choice for one miss."""

    tag: Tag  # the action to take
    predicted_cost: float = 0.0  # predicted quality cost in nats (approximate tags)
    reason: str = ""  # why, for the ledger
    is_forced: bool = False  # a fault leaves no exact action: served as decided even in observe mode
    failure: str = ""  # set: the request cannot be served (a quarantined expert it may not defer); it fails


@dataclasses.dataclass(slots=True)
class Victim:
    """An object to take off device: an expert (dropped, its home stays) or a KV block (spilled)."""

    expert_key: ExpertKey | None = None  # set for an expert
    kv_block_key: KVBlockKey | None = None  # set for a KV block
    spill_mode: SpillMode = SpillMode.HOST_FULL  # how a KV block's copy is kept


@dataclasses.dataclass(slots=True)
class StepEndActions:
    """What a controller wants done between steps; the engine executes it within the budgets."""

    spill: list[tuple[KVBlockKey, SpillMode]] = dataclasses.field(default_factory=list)  # KV to take off device
    evict_experts: list[ExpertKey] = dataclasses.field(default_factory=list)  # experts to drop from device
    promote_kv: list[KVBlockKey] = dataclasses.field(default_factory=list)  # staged KV to keep on device
    load_experts: list[ExpertKey] = dataclasses.field(default_factory=list)  # experts to prefetch


class Controller(abc.ABC):
    """Decides every action the engine may take differently; never moves bytes itself."""

    @abc.abstractmethod
    def expert_action(self, miss: ExpertMiss) -> Decision:
        """exact_load, cpu_execute, expert_defer or expert_lowbit for one request's use of one expert."""

    @abc.abstractmethod
    def kv_action(self, miss: KVMiss) -> Decision:
        """exact_load, kv_dequant or recompute for one off-device KV block."""

    @abc.abstractmethod
    def choose_victims(
        self,
        num_bytes: int,
        view: ControllerView,
        pinned_experts: Container[ExpertKey],
        pinned_kv: Container[KVBlockKey],
    ) -> Iterable[Victim]:
        """Objects to take off device so that `num_bytes` more fit, best victim first; may yield fewer than
        needed. The engine takes victims in order only until enough is free, so the result may be lazy (a
        generator over the controller's priority structures); it reads the view as it goes."""

    @property
    def reads_profile(self) -> bool:
        """Whether a decision may depend on ``view.profile`` or ``view.io_snapshot()`` (link and compute
        rates, the I/O queue). A controller that says False decides the same on every device model, so a
        simulation may share one decision pass among device models (default True: assume it does)."""
        return True

    def on_step_start(self, plan: StepPlan, view: ControllerView) -> None:  # noqa: B027 - optional hook
        """Called before each step's forward pass."""

    def on_step_end(self, view: ControllerView) -> StepEndActions:
        """Called after each step; default: nothing to do."""
        return StepEndActions()

    def fault_action(self, miss: ExpertMiss, fault: str) -> Decision | None:
        """The expert `miss` needs is quarantined (`fault` says why): an ``expert_defer`` Decision when the
        request's class allows it and its budget has room, else None (the request fails). Default: None."""
        return None

    def kv_fault_action(self, miss: KVMiss, fault: str) -> Decision | None:
        """A KV block's only full-precision copy failed its checksum: a ``recompute`` Decision when the
        request's class allows it, else None (the request fails). Default (no policy): recompute."""
        return Decision(Tag.RECOMPUTE, reason=f"{fault}; rebuilt by recompute")

    def choose_read_ahead(self, predicted: list[ExpertKey], view: ControllerView) -> list[ExpertKey]:
        """Which of the experts the next layer's router predicts (from this layer's hidden state) to read
        from disk ahead of use, in order; default: all of them (the store stops when host room runs out)."""
        return predicted

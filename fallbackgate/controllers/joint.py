"""The joint budget controller: one device budget for expert slots and KV blocks, one link per tier pair,
per-request quality budgets.

Per step it gives the link and the CPU the step's deadline (the tightest TPOT target among the step's
decoding requests, TTFT for prefill-only steps, less the profile's predicted dense time) and queues
transfers in priority order: KV blocks with a full-precision copy (no cheaper exact way to read them), then
expert misses — those of requests that
cannot fall back first, through a reservation of the expected miss time. A miss that cannot arrive in
time gets the cheapest fallback the request's class allows and whose predicted cost fits its remaining
budget: cpu_execute (same math), expert_lowbit, expert_defer; a KV block with only a quantized copy is
read with kv_dequant or rebuilt with recompute. A request with no budget left gets exact actions only;
its slipped deadline is recorded (``slips``) with the reason. At step boundaries bytes move to the side
with the higher value per byte (see :mod:`fallbackgate.controllers.values`).
"""

from __future__ import annotations

import dataclasses

from fallbackgate.controllers.arbitration import Arbitration, arbitrate, expert_arbitration
from fallbackgate.controllers.base import Recency
from fallbackgate.controllers.cost import CostModel, lowbit_error_energy
from fallbackgate.controllers.expected_misses import ExpectedMisses
from fallbackgate.controllers.expert_rank import ExpertRanking
from fallbackgate.controllers.joint_placement import JointPlacement
from fallbackgate.controllers.link import LinkBudget
from fallbackgate.controllers.registry import ControllerKind, register_controller
from fallbackgate.controllers.timing import cpu_expert_s, step_deadline_s
from fallbackgate.controllers.values import ValueModel
from fallbackgate.engine.controller import Controller, ControllerView, Decision, ExpertMiss, KVMiss
from fallbackgate.engine.experts.store import ExpertKey
from fallbackgate.engine.hardware import CPU_BOX
from fallbackgate.engine.kv.store import KVBlockKey
from fallbackgate.engine.messages import StepPlan
from fallbackgate.engine.tags import ObjectKind, Tag, Tier
from fallbackgate.policy.budgets import BudgetBook, RequestBudget
from fallbackgate.policy.schema import ExpertAdmission, Policy, QualityBudget


@dataclasses.dataclass(slots=True)
class Slip:
    """A deadline the controller let slip rather than break a request's quality budget or class."""

    step_id: int
    request_id: str
    object_kind: str  # an ObjectKind value
    reason: str


@register_controller(ControllerKind.JOINT, lambda cls, policy, o: cls(policy, o.cost_model, top_k=o.top_k))
class JointController(JointPlacement, Controller):
    """Joint expert/KV placement, link-time scheduling and budgeted fallbacks (see the module docstring)."""

    def __init__(self, policy: Policy, cost_model: CostModel | None = None, top_k: int = 1) -> None:
        self.policy, self.top_k = policy, top_k
        spec = policy.controller
        self.cost = cost_model or CostModel(lowbit_bits=spec.expert_lowbit_bits or 8)
        self.book = BudgetBook({n: c.budget for n, c in policy.classes.items()}, QualityBudget())
        self.values, self.recency = ValueModel(spec.routing_decay), Recency()
        self.ranking = ExpertRanking()  # device experts in victim order, kept between misses and steps
        self.current_layer = -1  # the layer of the step's last expert miss (-1: none yet; KV reads are all
        # decided before the forward, so they leave it at -1)
        self.expected = ExpectedMisses()  # the next step's expected miss time, kept between steps
        self.link = LinkBudget(CPU_BOX)
        self.kv_bits = spec.kv_quant_bits
        admission = spec.expert_admission
        self.is_lowbit_admission = admission in (ExpertAdmission.LOWBIT_COLDER, ExpertAdmission.LOWBIT_COLDER_DECODE)
        self.is_decode_only_admission = admission is ExpertAdmission.LOWBIT_COLDER_DECODE
        self.prefilling_ids: set[str] = set()  # decode-only admission: the step's prefilling requests
        self.step_id, self.is_observe = -1, False
        self.loading: set[ExpertKey] = set()
        self.lowbit_loading: set[ExpertKey] = set()  # experts whose low-bit copy this step already booked
        self.strict_reserve_s = 0.0
        self.cpu_left_s = 0.0  # CPU time left in this step for cpu_execute experts
        self.kv_energy: dict[KVBlockKey, float] = {}
        self.slips: list[Slip] = []
        self.view: ControllerView | None = None  # the engine's view, read to size quantization errors
        self.kv_plan: dict[KVBlockKey, Decision] = {}  # late exact KV copies served otherwise this step
        self.arbitrations: list[Arbitration] = []  # every late exact KV copy and what was served
        self.num_arbitrations_taken = 0  # how many of them take_arbitrations has handed out
        self.recomputing: set[str] = set()  # requests whose rebuild pass this step is already charged

    # --- per step --------------------------------------------------------------------------------
    def on_step_start(self, plan: StepPlan, view: ControllerView) -> None:
        self.link.profile, self.view = view.profile, view
        self.step_id, self.is_observe = plan.step_id, plan.is_observe
        self.current_layer = -1
        if self.is_decode_only_admission:
            self.prefilling_ids = {rid for rid in plan.request_ids if plan.num_tokens[rid] > 1}
        self.loading.clear()
        self.lowbit_loading.clear()
        deadline = step_deadline_s(self.policy, plan, view)
        self.link.reset(deadline, view.io_snapshot(), view.is_ram_tiered)
        self.cpu_left_s = deadline
        base = view.num_expert_layers * self.top_k  # expert objects a request surely uses this step
        for rid in plan.request_ids:
            self._budget(rid, view.request_class(rid)).begin_step(plan.step_id, plan.num_tokens[rid] == 1, base)
        self._queue_kv(plan, view)
        must = any(not self._can_fall_back(self.book.requests[r]) for r in plan.request_ids)
        expected = self.expected.seconds(view, self.values, self._home_load_s) if must else 0.0
        self.strict_reserve_s = min(expected, max(0.0, self.link.left_s[Tier.HOST]))

    def _queue_kv(self, plan: StepPlan, view: ControllerView) -> None:
        """KV blocks with a full copy queue first; one that would arrive late is arbitrated (see
        :mod:`fallbackgate.controllers.arbitration`) against the step's expert loads."""
        self.kv_plan.clear()
        self.recomputing.clear()
        for rid in plan.request_ids:
            start = plan.start_positions[rid]
            budget = self._budget(rid, view.request_class(rid))
            for block in view.off_device_kv_blocks(rid, start // view.block_size):  # layer, then index
                if block.exact_tier is not None:
                    if self.is_observe:  # observe serves exact copies: queue them, decide nothing
                        self.link.take(view.bytes_per_kv_block, block.exact_tier)
                        continue
                    decided = arbitrate(self, block, budget, start, view)
                    if decided is not None:
                        self.arbitrations.append(decided)

    def take_arbitrations(self) -> list[Arbitration]:
        """The arbitrations decided since the last call (what a recorder writes to the ledger)."""
        taken = self.arbitrations[self.num_arbitrations_taken :]
        self.num_arbitrations_taken = len(self.arbitrations)
        return taken

    def _home_load_s(self, home: Tier) -> float:
        """One expert's load time from `home` on the step's links now."""
        assert self.view is not None, "on_step_start gives the controller its view"
        return sum(self.link.legs(self.view.bytes_per_expert, home).values())

    def _budget(self, request_id: str, request_class: str) -> RequestBudget:
        return self.book.get(request_id, request_class)

    def _can_fall_back(self, budget: RequestBudget) -> bool:
        tags = budget.limits.allowed_tags
        return Tag.CPU_EXECUTE.value in tags or (not budget.is_spent and bool(tags))

    # --- decisions -------------------------------------------------------------------------------
    def expert_action(self, miss: ExpertMiss) -> Decision:
        budget = self._budget(miss.request_id, miss.request_class)
        key = (miss.layer, miss.expert_id)
        self.current_layer = miss.layer
        if key in self.loading:  # another request of this step already queued its load
            budget.spend(Tag.EXACT_LOAD, 0.0, True)
            return Decision(Tag.EXACT_LOAD)
        reserve = 0.0 if not self._can_fall_back(budget) else self.strict_reserve_s
        self.link.reserve_s(Tier.HOST, reserve)
        in_time = self.link.fits(miss.num_bytes, miss.home)
        self.link.release_s(Tier.HOST, reserve)
        if in_time:
            is_admitting = (  # observe serves exact: nothing to admit; decode-only skips prefilling requests
                self.is_lowbit_admission and not self.is_observe and miss.request_id not in self.prefilling_ids
            )
            admitted = self._lowbit_when_colder(miss, budget) if is_admitting else None
            return admitted or self._load(miss, budget, "")
        candidates = self._expert_fallbacks(miss)
        notes = [budget.why_not(tag, cost) for tag, cost in candidates]  # before any of them is spent
        late = (
            sum(self.link.legs(miss.num_bytes, miss.home).values()),
            self.link.late_text("expert load", miss.num_bytes, miss.home),
        )  # before anything is booked
        weighed_s = [self._fallback_s(miss, tag) for tag, _ in candidates]  # as weighed, before booking
        for (tag, cost), note in zip(candidates, notes, strict=True):
            if not note:
                budget.spend(tag, cost, True)
                arrival = 0.0  # expert_defer: nothing arrives, the expert's share is skipped
                if tag is Tag.EXPERT_LOWBIT:
                    self.link.take_legs(self._lowbit_legs(miss))
                    self.lowbit_loading.add(key)
                    arrival = self.link.used_s(Tier.DISK if miss.lowbit_disk_bytes else Tier.HOST)
                if tag is Tag.CPU_EXECUTE:  # the step's CPU experts run one after another: their times add up
                    self.cpu_left_s -= cpu_expert_s(self.link.profile, miss)
                    arrival = self.link.deadline_s - self.cpu_left_s
                self._note_late_expert(miss, late, candidates, notes, weighed_s, (tag, cost, "deadline", arrival))
                return Decision(tag, cost, "deadline")
        reason = "slo slip: quality budget spent" if budget.is_spent else "slo slip: no allowed fallback fits"
        self.slips.append(Slip(self.step_id, miss.request_id, ObjectKind.EXPERT.value, reason))
        decision = self._load(miss, budget, reason)
        arrival = self.link.used_s(miss.home)
        self._note_late_expert(miss, late, candidates, notes, weighed_s, (Tag.EXACT_LOAD, 0.0, reason, arrival))
        return decision

    def _note_late_expert(
        self,
        miss: ExpertMiss,
        late: tuple[float, str],
        candidates: list[tuple[Tag, float]],
        notes: list[str],
        weighed_s: list[float],
        chosen: tuple[Tag, float, str, float],
    ) -> None:
        """Keep a late expert load's arbitration: the late load, every fallback weighed (its predicted seconds
        as weighed, before anything was booked, and why it was not feasible), the choice (tag, cost, reason,
        arrival)."""
        if self.is_observe:  # observe serves exactly and decides nothing, as for KV copies
            return
        choice, cost, reason, arrival_s = chosen
        rows = zip(candidates, weighed_s, notes, strict=True)
        weighed = [(tag, seconds, option_cost, note) for (tag, option_cost), seconds, note in rows]
        decided = expert_arbitration(self.step_id, miss, self.link, late, weighed, (choice, cost, arrival_s), reason)
        self.arbitrations.append(decided)

    def _fallback_s(self, miss: ExpertMiss, tag: Tag) -> float:
        """Predicted seconds an expert fallback takes: CPU time, the low-bit copy's link time, or none."""
        if tag is Tag.CPU_EXECUTE:
            return cpu_expert_s(self.link.profile, miss)
        if tag is Tag.EXPERT_LOWBIT:
            return sum(self._lowbit_legs(miss).values())
        return 0.0

    def _lowbit_legs(self, miss: ExpertMiss) -> dict[Tier, float]:
        """Link seconds the low-bit copy takes: its disk read first when it has no copy in memory (persisted:
        a low-bit copy's bytes; none at all: the whole expert from the checkpoint), then, off the RAM/disk
        layout, the low-bit bytes to the device; nothing when another request's miss booked it this step (the
        engine makes one copy per expert and step)."""
        legs: dict[Tier, float] = {}
        if (miss.layer, miss.expert_id) in self.lowbit_loading:
            return legs
        if miss.lowbit_disk_bytes:
            legs[Tier.DISK] = self.link.legs(miss.lowbit_disk_bytes, Tier.DISK)[Tier.DISK]
        if not self.link.is_ram_tiered:
            legs.update(self.link.legs(self._lowbit_bytes(), Tier.HOST))
        return legs

    def _lowbit_when_colder(self, miss: ExpertMiss, budget: RequestBudget) -> Decision | None:
        """``expert_admission: lowbit_colder``: an in-time miss whose expert is colder than the first expert
        its exact copy would evict computes with its low-bit copy instead (it takes no expert slot; its
        computation holds a dequantization scratch while it runs) when the copy reads fewer bytes than the
        expert and arrives in time, the request's class allows ``expert_lowbit`` and its budget holds the cost;
        None otherwise."""
        assert self.view is not None, "on_step_start gives the controller its view"
        if not miss.is_lowbit_available or not miss.lowbit_disk_bytes < miss.num_bytes:
            return None  # made from the checkpoint, the copy would read the whole expert
        if not self.link.fits_legs(self._lowbit_legs(miss)) or not self.is_colder_than_victim(miss, self.view):
            return None
        cost = self.cost.expert_cost(Tag.EXPERT_LOWBIT, miss.layer, miss.max_gate_weight)
        if budget.why_not(Tag.EXPERT_LOWBIT, cost):
            return None
        budget.spend(Tag.EXPERT_LOWBIT, cost, True)
        self.link.take_legs(self._lowbit_legs(miss))
        self.lowbit_loading.add((miss.layer, miss.expert_id))
        return Decision(Tag.EXPERT_LOWBIT, cost, "admission: colder than its first victim")

    def _load(self, miss: ExpertMiss, budget: RequestBudget, reason: str) -> Decision:
        self.link.take(miss.num_bytes, miss.home)
        self.loading.add((miss.layer, miss.expert_id))
        budget.spend(Tag.EXACT_LOAD, 0.0, True)
        return Decision(Tag.EXACT_LOAD, reason=reason)

    def _expert_fallbacks(self, miss: ExpertMiss) -> list[tuple[Tag, float]]:
        """Fallbacks in order of preference: same math on the CPU when it beats the late load, then by cost.
        The low-bit copy is offered when it arrives in time, or sooner than the late exact load would (the
        deadline is missed either way; the smaller read misses it by less): on the RAM/disk layout one that
        must first be made from the checkpoint reads the whole expert, so it is neither (elsewhere its smaller
        host-to-device leg may still win; the CPU time to quantize it is not modeled)."""
        options: list[tuple[Tag, float]] = []
        cpu_s = cpu_expert_s(self.link.profile, miss)
        exact_s = sum(self.link.legs(miss.num_bytes, miss.home).values())
        is_faster = cpu_s < exact_s and cpu_s <= self.cpu_left_s
        if miss.is_cpu_execute_offered and is_faster:
            options.append((Tag.CPU_EXECUTE, 0.0))
        lowbit_legs = self._lowbit_legs(miss) if miss.is_lowbit_available else {}
        if miss.is_lowbit_available and (self.link.fits_legs(lowbit_legs) or sum(lowbit_legs.values()) < exact_s):
            options.append(
                (Tag.EXPERT_LOWBIT, self.cost.expert_cost(Tag.EXPERT_LOWBIT, miss.layer, miss.max_gate_weight))
            )
        options.append((Tag.EXPERT_DEFER, self.cost.expert_cost(Tag.EXPERT_DEFER, miss.layer, miss.max_gate_weight)))
        return options

    def _lowbit_bytes(self) -> int:
        """Bytes of one expert's low-bit copy as the engine stores it (what crosses the link)."""
        assert self.view is not None, "on_step_start gives the controller its view"
        return self.view.quantized_bytes(ObjectKind.EXPERT, self.cost.lowbit_bits)

    def kv_action(self, miss: KVMiss) -> Decision:
        budget = self._budget(miss.request_id, miss.request_class)
        planned = self.kv_plan.pop((miss.request_id, miss.layer, miss.block_index), None)
        if planned is not None:  # budget already spent by the arbitration that planned it
            return planned
        if miss.exact_tier is not None:
            budget.spend(Tag.EXACT_LOAD, 0.0, False)
            if self.link.left_s.get(Tier.HOST, 0.0) < 0:
                self.slips.append(
                    Slip(self.step_id, miss.request_id, ObjectKind.KV_BLOCK.value, "slo slip: exact KV copy late")
                )
            return Decision(Tag.EXACT_LOAD)
        if miss.quant_tier is not None:
            key = (miss.request_id, miss.layer, miss.block_index)
            cost = self.cost.kv_cost(miss.layer, self.kv_error_energy(key, miss.quant_bits))
            if budget.fits(Tag.KV_DEQUANT, cost):
                budget.spend(Tag.KV_DEQUANT, cost, False)
                assert self.view is not None, "on_step_start gives the controller its view"
                self.link.take(self.view.quantized_bytes(ObjectKind.KV_BLOCK, miss.quant_bits), miss.quant_tier)
                return Decision(Tag.KV_DEQUANT, cost, "quantized copy")
            budget.spend(Tag.RECOMPUTE, 0.0, False)
            return Decision(Tag.RECOMPUTE, reason="budget spent: rebuilt exactly from tokens")
        budget.spend(Tag.RECOMPUTE, 0.0, False)
        return Decision(Tag.RECOMPUTE, reason="no copy")

    def fault_action(self, miss: ExpertMiss, fault: str) -> Decision | None:
        """A quarantined expert: deferred when the class allows expert_defer and its predicted cost fits."""
        budget = self._budget(miss.request_id, miss.request_class)
        cost = self.cost.expert_cost(Tag.EXPERT_DEFER, miss.layer, miss.max_gate_weight)
        if not budget.fits(Tag.EXPERT_DEFER, cost):
            return None
        budget.spend(Tag.EXPERT_DEFER, cost, True)
        return Decision(Tag.EXPERT_DEFER, cost, "no readable copy")

    def kv_fault_action(self, miss: KVMiss, fault: str) -> Decision | None:
        """An unreadable KV copy: rebuilt when the class allows recompute."""
        budget = self._budget(miss.request_id, miss.request_class)
        if not budget.allows(Tag.RECOMPUTE):
            return None
        budget.spend(Tag.RECOMPUTE, 0.0, False)
        return Decision(Tag.RECOMPUTE, reason=f"{fault}; rebuilt by recompute")

    def kv_error_energy(self, key: KVBlockKey, bits: int) -> float:
        """Relative error energy of a block's quantized copy, cached per block (the `bits`' default when the
        copy cannot be read)."""
        cached = self.kv_energy.get(key)
        if cached:
            return cached
        energy = self.view.kv_quant_error_energy(key) if self.view is not None else None
        self.kv_energy[key] = energy if energy is not None else lowbit_error_energy(bits)
        return self.kv_energy[key]

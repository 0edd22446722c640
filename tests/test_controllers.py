"""Controllers under random routing, link pressure, budgets and class mixes (hypothesis).

Synthetic miss sequences drive the joint controller directly: no decision ever uses a tag the request's
class disallows, no request's predicted spend exceeds its budget (mean over its positions, per step,
approximate fraction), and exact-only classes never see an approximate tag.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fallbackgate.controllers import ControllerKind, JointController, make_controller
from fallbackgate.engine.controller import ExpertMiss, KVMiss
from fallbackgate.engine.experts.quant import lowbit_expert_nbytes
from fallbackgate.engine.hardware import CPU_BOX, HardwareProfile
from fallbackgate.engine.kv.codec import quant_kv_nbytes
from fallbackgate.engine.messages import StepKind, StepPlan
from fallbackgate.engine.static_view import StaticView
from fallbackgate.engine.tags import ObjectKind, Tag, Tier
from fallbackgate.policy.schema import FALLBACK_TAGS, SLO, Policy, QualityBudget, RequestClass

LAYERS, TOP_K, EXPERTS = 4, 2, 8
EXPERT_BYTES = 1 << 20
SLOW = HardwareProfile("slow", 2e8, 2e8, 1e8, 1e8, 1e10, 1e10, 1e-5)
EXACT = {Tag.RESIDENT, Tag.EXACT_LOAD}
EXPERT_SHAPES = ((256, 512), (256, 512))  # fp32: 2 × 128 Ki × 4 B = EXPERT_BYTES
KV_BLOCK_SHAPE, KV_KEY_DIM = (4, 16, 256), 128  # fp32: 64 KiB
QUANT_BYTES = {
    (kind, bits): lowbit_expert_nbytes(EXPERT_SHAPES, bits)
    if kind is ObjectKind.EXPERT
    else quant_kv_nbytes(KV_BLOCK_SHAPE, bits, KV_KEY_DIM)
    for kind in ObjectKind
    for bits in (8, 4)
}


def fake_view(profile: HardwareProfile, request_classes: dict[str, str], running_ids: list[str]) -> StaticView:
    """Nothing on device and no KV block tables (KV misses arrive synthetically); experts homed on the host."""
    return StaticView(
        profile,
        request_classes,
        tuple(running_ids),
        device_budget_bytes=8 * EXPERT_BYTES,
        bytes_per_expert=EXPERT_BYTES,
        num_layers=LAYERS,
        block_size=16,
        bytes_per_kv_block=64 * 1024,
        quantized_copy_bytes=QUANT_BYTES,
    )


budgets = st.builds(
    lambda tags, mean, ratio, frac, top1: QualityBudget(
        max_mean_kl=mean,
        max_p99_kl=mean * ratio,
        max_approx_fraction=frac,
        allowed_tags=sorted(tags),
        min_top1_agreement=top1,
    ),
    st.sets(st.sampled_from(FALLBACK_TAGS)),
    st.sampled_from([0.0, 1e-6, 1e-3, 0.02, 0.2, 2.0]),
    st.sampled_from([1.0, 2.0, 10.0]),
    st.sampled_from([0.0, 0.05, 0.3, 1.0]),
    st.sampled_from([0.0, 0.5, 0.9, 1.0]),
)
classes = st.lists(st.tuples(budgets, st.sampled_from([0.001, 0.05, 1.0, 100.0])), min_size=1, max_size=3)
expert_miss = st.tuples(
    st.just("expert"),
    st.integers(0, 5),
    st.integers(0, LAYERS - 1),
    st.integers(0, EXPERTS - 1),
    st.floats(0.0, 1.0),
    st.booleans(),
    st.integers(1, 8),
)
kv_miss = st.tuples(st.just("kv"), st.integers(0, 5), st.integers(0, LAYERS - 1), st.integers(0, 7), st.integers(0, 2))
steps = st.lists(
    st.tuples(st.lists(st.booleans(), min_size=6, max_size=6), st.lists(st.one_of(expert_miss, kv_miss), max_size=40)),
    min_size=1,
    max_size=12,
)


def _policy(spec: list[tuple[QualityBudget, float]]) -> Policy:
    cls = {
        f"c{i}": RequestClass(slo=SLO(tpot_ms=tpot, ttft_ms=tpot * 10), budget=b) for i, (b, tpot) in enumerate(spec)
    }
    return Policy(classes=cls, default_class="c0")


@dataclasses.dataclass
class Ledger:
    """The test's own account of what a request was given."""

    limits: QualityBudget
    positions: int = 0
    spent: float = 0.0
    approx: int = 0
    objects: int = 0
    tags: set = dataclasses.field(default_factory=set)


def _kv(miss: tuple, rid: str, cls: str, limits: QualityBudget, step_id: int) -> KVMiss | None:
    """A KV miss whose copies are ones the joint controller itself would have kept for this class."""
    _, _, layer, index, copy = miss
    may_quant = {"kv_dequant", "recompute"} <= set(limits.allowed_tags)
    if copy == 1 and may_quant:
        return KVMiss(step_id, rid, cls, layer, index, None, Tier.HOST, 8, 64 * 1024)
    if copy == 2 and "recompute" in limits.allowed_tags:
        return KVMiss(step_id, rid, cls, layer, index, None, None, 0, 64 * 1024)
    return KVMiss(step_id, rid, cls, layer, index, Tier.HOST, None, 0, 64 * 1024)


def _drive(controller: JointController, policy: Policy, assign: list[int], plan_steps: list, profile) -> dict:
    names = [f"c{i % len(policy.classes)}" for i in assign]
    accounts = {f"r{i}": Ledger(policy.classes[names[i]].budget) for i in range(6)}
    for step_id, (active, misses) in enumerate(plan_steps, start=1):
        rids = [f"r{i}" for i in range(6) if active[i]] or ["r0"]
        plan = StepPlan(step_id, StepKind.DECODE, rids, dict.fromkeys(rids, 1), dict.fromkeys(rids, 32))
        view = fake_view(profile, {f"r{i}": names[i] for i in range(6)}, rids)
        controller.on_step_start(plan, view)
        step_spent = dict.fromkeys(rids, 0.0)
        expert_uses = dict.fromkeys(rids, 0)
        for rid in rids:
            accounts[rid].positions += 1
        for miss in misses:
            rid = rids[miss[1] % len(rids)]
            cls, acc = names[int(rid[1:])], accounts[rid]
            if miss[0] == "expert":
                _, _, layer, expert, weight, lowbit, tokens = miss
                decision = controller.expert_action(
                    ExpertMiss(step_id, rid, cls, layer, expert, tokens, weight, Tier.HOST, EXPERT_BYTES, lowbit, False)
                )
                expert_uses[rid] += 1
            else:
                decision = controller.kv_action(_kv(miss, rid, cls, acc.limits, step_id))
                acc.objects += 1
            acc.tags.add(decision.tag)
            if decision.tag.is_approximate:
                acc.approx += 1
                acc.spent += decision.predicted_cost
                step_spent[rid] += decision.predicted_cost
            else:
                assert decision.predicted_cost == 0.0
        for rid in rids:
            accounts[rid].objects += max(LAYERS * TOP_K, expert_uses[rid])
            assert step_spent[rid] <= accounts[rid].limits.max_p99_kl + 1e-9, (rid, step_spent[rid])
        controller.on_step_end(view)
    return accounts


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(classes, st.lists(st.integers(0, 2), min_size=6, max_size=6), steps, st.sampled_from([CPU_BOX, SLOW]))
def test_joint_never_breaks_class_or_budget(spec, assign, plan_steps, profile) -> None:
    policy = _policy(spec)
    controller = make_controller(ControllerKind.JOINT, policy, top_k=TOP_K)
    accounts = _drive(controller, policy, assign, plan_steps, profile)
    for rid, acc in accounts.items():
        allowed = EXACT | {Tag(t) for t in acc.limits.allowed_tags}
        assert acc.tags <= allowed, (rid, acc.tags, allowed)
        if not any(Tag(t).is_approximate for t in acc.limits.allowed_tags):
            assert not any(t.is_approximate for t in acc.tags)
        assert acc.spent <= acc.limits.max_mean_kl * max(acc.positions, 1) + 1e-9, (rid, acc.spent, acc.positions)
        assert acc.approx <= acc.limits.max_approx_fraction * acc.objects + 1e-9, (rid, acc.approx, acc.objects)


@settings(max_examples=30, deadline=None)
@given(steps)
def test_ample_link_time_serves_everything_exactly(plan_steps) -> None:
    generous = QualityBudget(
        max_mean_kl=1.0,
        max_p99_kl=5.0,
        max_approx_fraction=1.0,
        allowed_tags=list(FALLBACK_TAGS),
        min_top1_agreement=0.0,
    )
    roomy = RequestClass(slo=SLO(tpot_ms=1e6, ttft_ms=1e6), budget=generous)
    policy = Policy(classes={"c0": roomy}, default_class="c0")
    controller = make_controller("joint", policy, top_k=TOP_K)
    accounts = _drive(controller, policy, [0] * 6, plan_steps, CPU_BOX)
    for acc in accounts.values():  # only a block whose one copy is quantized is read dequantized
        assert not acc.tags & {Tag.EXPERT_DEFER, Tag.EXPERT_LOWBIT, Tag.CPU_EXECUTE}, acc.tags


def test_spent_budget_serves_exactly_and_records_the_slip() -> None:
    tight = QualityBudget(
        max_mean_kl=0.01, max_p99_kl=0.02, max_approx_fraction=1.0, allowed_tags=["expert_defer"], min_top1_agreement=0
    )
    policy = Policy(classes={"be": RequestClass(slo=SLO(tpot_ms=0.001), budget=tight)}, default_class="be")
    controller = make_controller("joint", policy, top_k=TOP_K)
    plan = StepPlan(1, StepKind.DECODE, ["r"], {"r": 1}, {"r": 8})
    view = fake_view(SLOW, {"r": "be"}, ["r"])
    controller.on_step_start(plan, view)
    first = controller.expert_action(ExpertMiss(1, "r", "be", 0, 1, 1, 0.05, Tier.HOST, EXPERT_BYTES, False, False))
    assert first.tag is Tag.EXPERT_DEFER and 0 < first.predicted_cost <= 0.01
    second = controller.expert_action(ExpertMiss(1, "r", "be", 1, 2, 1, 0.5, Tier.HOST, EXPERT_BYTES, False, False))
    assert second.tag is Tag.EXACT_LOAD and second.reason.startswith("slo slip")
    assert [s.request_id for s in controller.slips] == ["r"]


def test_factory_builds_every_kind() -> None:
    kinds = {kind: type(make_controller(kind)).__name__ for kind in ControllerKind}
    assert kinds == {
        ControllerKind.JOINT: "JointController",
        ControllerKind.STATIC_SPLIT: "StaticSplitController",
        ControllerKind.INDEPENDENT_LRU: "IndependentLRUController",
        ControllerKind.EXACT_LRU: "ExactLRUController",
    }


def test_a_disk_read_on_the_ram_disk_layout_takes_the_disk_leg_only() -> None:
    """On a CPU a disk read lands in RAM: its time is the disk's, with no host-to-device copy after it (a
    host link slower than the disk makes the difference decide the miss)."""
    profile = dataclasses.replace(SLOW, host_to_device_bytes_per_s=5e7)
    disk_s = EXPERT_BYTES / profile.disk_to_host_bytes_per_s
    pcie_s = profile.link_latency_s + EXPERT_BYTES / profile.host_to_device_bytes_per_s
    assert pcie_s > 1.5 * disk_s
    defer = QualityBudget(
        max_mean_kl=1.0, max_p99_kl=5.0, max_approx_fraction=1.0, allowed_tags=["expert_defer"], min_top1_agreement=0
    )
    tpot_ms = 1e3 * (profile.dense_step_s(LAYERS, 0.0) + 1.2 * disk_s)  # the disk read fits; its PCIe copy not
    policy = Policy(classes={"c": RequestClass(slo=SLO(tpot_ms=tpot_ms), budget=defer)}, default_class="c")
    plan = StepPlan(1, StepKind.DECODE, ["r"], {"r": 1}, {"r": 8})
    miss = ExpertMiss(1, "r", "c", 0, 1, 1, 0.5, Tier.DISK, EXPERT_BYTES, False, False)
    tags = {}
    for is_ram_tiered in (False, True):
        controller = make_controller("joint", policy, top_k=TOP_K)
        view = dataclasses.replace(fake_view(profile, {"r": "c"}, ["r"]), is_ram_tiered=is_ram_tiered)
        controller.on_step_start(plan, view)
        legs = controller.link.legs(EXPERT_BYTES, Tier.DISK)
        assert legs == ({Tier.DISK: disk_s} if is_ram_tiered else {Tier.DISK: disk_s, Tier.HOST: pcie_s})
        tags[is_ram_tiered] = controller.expert_action(miss).tag
        if is_ram_tiered:  # the exact load queued its disk read and left the host link untouched
            assert controller.link.used_s(Tier.DISK) == pytest.approx(disk_s)
            assert controller.link.left_s[Tier.HOST] == controller.link.deadline_s
    assert tags == {False: Tag.EXPERT_DEFER, True: Tag.EXACT_LOAD}


def test_a_dense_layer_does_not_count_toward_the_approximate_fraction() -> None:
    """The share of approximate objects is bounded over the expert uses a request really has: a dense layer
    (the bundled model's first) routes to no expert, so it adds none (it once added ``top_k`` per step, and
    requests went 0.315 approximate under a 0.3 budget)."""
    budget = QualityBudget(
        max_mean_kl=1.0, max_p99_kl=2.0, max_approx_fraction=0.3, allowed_tags=["expert_lowbit"], min_top1_agreement=0
    )
    policy = Policy(classes={"c": RequestClass(slo=SLO(tpot_ms=0.001), budget=budget)}, default_class="c")
    controller = make_controller("joint", policy, top_k=TOP_K)
    view = dataclasses.replace(fake_view(SLOW, {"r": "c"}, ["r"]), num_layers=LAYERS + 1, num_expert_layers=LAYERS)
    approx = uses = 0
    for step_id in range(1, 21):
        controller.on_step_start(StepPlan(step_id, StepKind.DECODE, ["r"], {"r": 1}, {"r": 8}), view)
        for layer in range(1, LAYERS + 1):  # layer 0 is dense
            for expert in range(TOP_K):
                miss = ExpertMiss(step_id, "r", "c", layer, expert, 1, 0.5, Tier.HOST, EXPERT_BYTES, True, False)
                approx += controller.expert_action(miss).tag.is_approximate
                uses += 1
        controller.on_step_end(view)
    assert uses == 20 * LAYERS * TOP_K
    assert 0.25 * uses < approx <= 0.3 * uses

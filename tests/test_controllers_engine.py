"""Real small engine runs under every controller: tags stay within each request's class, predicted spend
within its budget, exact-only classes exact, and observe mode serves exactly."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fallbackgate.controllers import ControllerKind, make_controller
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.hardware import HardwareProfile
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.engine.tags import Tag
from fallbackgate.policy.schema import FALLBACK_TAGS, SLO, Policy, QualityBudget, RequestClass
from tests.test_engine_exact import sizes

SLOW = HardwareProfile("slow-link", 5e7, 5e7, 2e7, 2e7, 4e10, 4e10, 1e-6)
NEW_TOKENS = 6


def _serve(
    path,
    controller,
    budget_bytes: int,
    classes: list[str],
    observe: bool = False,
    seed: int = 0,
    is_emulated: bool = False,
):
    engine = Engine(
        EngineConfig(
            model_dir=str(path),
            block_size=4,
            max_num_seqs=3,
            device_budget_bytes=budget_bytes,
            profile=SLOW,
            is_observe=observe,
            is_emulated_device_tier=is_emulated,  # cpu_execute allowed: a GPU machine's tiers, emulated
        ),
        controller,
    )
    rng = random.Random(seed)
    for i, cls in enumerate(classes):
        prompt = [rng.randrange(3, 300) for _ in range(rng.choice([5, 19]))]
        engine.add_request(prompt, SamplingParams(max_new_tokens=NEW_TOKENS), f"r{i}", cls)
    per_request: dict[str, dict[Tag, int]] = {}
    cost: dict[str, float] = {}
    while engine.has_unfinished():
        for event in engine.step().events:
            tags = per_request.setdefault(event.request_id, {})
            tags[event.tag] = tags.get(event.tag, 0) + event.count
            cost[event.request_id] = cost.get(event.request_id, 0.0) + event.predicted_cost
    return engine, per_request, cost


budgets = st.builds(
    lambda tags, mean, frac: QualityBudget(
        max_mean_kl=mean, max_p99_kl=mean * 3, max_approx_fraction=frac, allowed_tags=sorted(tags), min_top1_agreement=0
    ),
    st.sets(st.sampled_from(FALLBACK_TAGS)),
    st.sampled_from([1e-6, 0.01, 0.3]),
    st.sampled_from([0.0, 0.2, 1.0]),
)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(budgets, min_size=2, max_size=2), st.lists(st.integers(0, 1), min_size=3, max_size=3), st.booleans())
@example(  # the fraction's denominator counts resident uses, as the budget's and the audit gate's do
    specs=[
        QualityBudget(
            max_mean_kl=0.01,
            max_p99_kl=0.03,
            max_approx_fraction=0.2,
            allowed_tags=["expert_lowbit"],
            min_top1_agreement=0,
        ),
        QualityBudget(
            max_mean_kl=1e-6,
            max_p99_kl=3e-6,
            max_approx_fraction=0.0,
            allowed_tags=["cpu_execute"],
            min_top1_agreement=0,
        ),
    ],
    assign=[0, 0, 0],
    observe=False,
)
def test_joint_real_runs_respect_classes_and_budgets(checkpoint_factory, specs, assign, observe) -> None:
    path = checkpoint_factory("qwen3_moe")
    expert, block, layers, top_k = sizes(path)
    classes = {f"c{i}": RequestClass(slo=SLO(tpot_ms=0.05, ttft_ms=1.0), budget=b) for i, b in enumerate(specs)}
    policy = Policy(classes=classes, default_class="c0")
    controller = make_controller("joint", policy, top_k=top_k)
    names = [f"c{i}" for i in assign]
    is_emulated = any("cpu_execute" in b.allowed_tags for b in specs)
    budget = 4 * expert + 10 * layers * block
    engine, tags, cost = _serve(path, controller, budget, names, observe, is_emulated=is_emulated)
    for i, name in enumerate(names):
        rid, limits = f"r{i}", classes[name].budget
        served = {t for t, n in tags.get(rid, {}).items() if n}
        allowed = {Tag.RESIDENT, Tag.EXACT_LOAD} | {Tag(t) for t in limits.allowed_tags}
        assert served <= allowed, (rid, served, allowed)
        approx = sum(n for t, n in tags[rid].items() if t.is_approximate)
        if observe or not any(Tag(t).is_approximate for t in limits.allowed_tags):
            assert approx == 0, (rid, tags[rid])
        assert cost.get(rid, 0.0) <= limits.max_mean_kl * NEW_TOKENS + 1e-9
        served_counts = engine.finished[rid].tag_counts  # events plus resident expert uses
        moved = {t: n for t, n in tags[rid].items() if t is not Tag.RESIDENT and n}
        assert {Tag(t): n for t, n in served_counts.items() if t != Tag.RESIDENT.value and n} == moved
        assert approx <= limits.max_approx_fraction * sum(served_counts.values()) + 1e-9
        assert len(engine.finished[rid].output_token_ids) == NEW_TOKENS


def test_joint_uses_fallbacks_for_best_effort_only(checkpoint_factory) -> None:
    path = checkpoint_factory("qwen3_moe")
    expert, block, layers, top_k = sizes(path)
    approx_tags = ["expert_defer", "expert_lowbit", "kv_dequant", "recompute"]  # no cpu_execute: approximate only
    loose = QualityBudget(
        max_mean_kl=0.5, max_p99_kl=2.0, max_approx_fraction=0.5, allowed_tags=approx_tags, min_top1_agreement=0.0
    )
    policy = Policy(
        classes={
            "strict": RequestClass(slo=SLO(tpot_ms=0.05)),
            "best-effort": RequestClass(slo=SLO(tpot_ms=0.05), budget=loose),
        },
        default_class="strict",
    )
    controller = make_controller("joint", policy, top_k=top_k)
    _, tags, cost = _serve(path, controller, 4 * expert + 10 * layers * block, ["strict", "best-effort", "strict"])
    assert not any(t.is_approximate for rid in ("r0", "r2") for t in tags[rid])
    assert sum(n for t, n in tags["r1"].items() if t.is_approximate) > 0, tags["r1"]
    assert 0 < cost["r1"] <= 0.5 * NEW_TOKENS


BASELINES = [ControllerKind.STATIC_SPLIT, ControllerKind.INDEPENDENT_LRU, ControllerKind.EXACT_LRU]


@pytest.mark.parametrize("kind", BASELINES)
def test_baselines_serve_exactly_under_pressure(checkpoint_factory, kind: ControllerKind) -> None:
    path = checkpoint_factory("qwen3_moe")
    expert, block, layers, top_k = sizes(path)
    engine, tags, _ = _serve(path, make_controller(kind), 3 * expert + 8 * layers * block, ["default"] * 3)
    served = {t for per in tags.values() for t in per}
    assert not any(t.is_approximate for t in served), served
    assert Tag.EXACT_LOAD in served
    assert all(len(o.output_token_ids) == NEW_TOKENS for o in engine.finished.values())

"""The controllers' view of the engine: exactly the queries controllers make, plain values and immutable
snapshots only, served by a live engine and by plain data alike."""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
import random
import re
from collections.abc import Iterable, Iterator
from types import MappingProxyType
from typing import Any

import pytest

from fallbackgate.controllers import ExactLRUController, JointController, StaticSplitController
from fallbackgate.engine.config import EngineConfig
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
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.hardware import CPU_BOX, HardwareProfile
from fallbackgate.engine.io import IOOp
from fallbackgate.engine.messages import StepKind, StepPlan
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.engine.static_view import StaticView
from fallbackgate.engine.tags import ObjectKind, Tag, Tier
from fallbackgate.policy.schema import SLO, Policy, QualityBudget, RequestClass
from tests.test_engine_exact import sizes

ROOT = pathlib.Path(__file__).resolve().parents[1]
MEMBERS = {name for name in vars(ControllerView) if not name.startswith("_")}
PLAIN = (int, float, str, bool, type(None), Tier, Tag, ObjectKind, IOOp, HardwareProfile)


def _queries_made_by_controllers() -> set[str]:
    sources = [*(ROOT / "fallbackgate" / "controllers").glob("*.py"), ROOT / "fallbackgate" / "sweep" / "belady.py"]
    return {m for path in sources for m in re.findall(r"\bview\.([a-z_]+)", path.read_text())}


def test_the_view_has_exactly_the_queries_controllers_make() -> None:
    assert _queries_made_by_controllers() == MEMBERS


def _immutable_parts(value: Any, where: str) -> Iterator[str]:
    """Names of every part of `value` that is not a plain value or an immutable collection of them."""
    if isinstance(value, PLAIN):
        return
    if dataclasses.is_dataclass(value) and type(value).__dataclass_params__.frozen:  # the I/O queue's snapshot
        for field in dataclasses.fields(value):
            yield from _immutable_parts(getattr(value, field.name), f"{where}.{field.name}")
    elif isinstance(value, tuple):  # tuples and NamedTuple snapshots
        for i, item in enumerate(value):
            yield from _immutable_parts(item, f"{where}[{i}]")
    elif isinstance(value, MappingProxyType):
        for key, item in value.items():
            yield from _immutable_parts(key, f"{where} key")
            yield from _immutable_parts(item, f"{where}[{key!r}]")
    else:
        yield f"{where}: {type(value).__name__}"


class ViewProbe(Controller):
    """Delegates to `inner`; at every call it asks the view every query and keeps whatever is not immutable."""

    def __init__(self, inner: Controller) -> None:
        self.inner, self.mutable, self.num_probes = inner, [], 0
        self.num_quant_copies = self.num_device_blocks = 0  # what the probes saw

    def probe(self, view: ControllerView) -> None:
        self.num_probes += 1
        blocks = view.device_kv_blocks()
        keys = [*view.device_expert_keys(), (0, 0)]
        rids = list(view.running_ids) or ["none"]
        answers: dict[str, Any] = {name: getattr(view, name) for name in MEMBERS if not callable(getattr(view, name))}
        answers |= {
            "request_class": [view.request_class(r) for r in rids],
            "device_used_bytes": [view.device_used_bytes(k) for k in ObjectKind],
            "device_expert_keys": view.device_expert_keys(),
            "is_expert_on_device": [view.is_expert_on_device(k) for k in keys],
            "expert_home": [view.expert_home(k) for k in keys],
            "expert_changes_since": [view.expert_changes_since(c) for c in (-1, 0)],
            "kv_changes_since": [view.kv_changes_since(c) for c in (-1, 0)],
            "num_kv_tokens": [view.num_kv_tokens(r) for r in rids],
            "quantized_bytes": [view.quantized_bytes(k, bits) for k in ObjectKind for bits in (8, 4)],
            "off_device_kv_blocks": [view.off_device_kv_blocks(r, 99) for r in view.running_ids],
            "device_kv_blocks_of": [tuple(view.device_kv_blocks_of(r)) for r in view.kv_request_ids],
            "device_kv_blocks": blocks,
            "staged_kv_tag": [view.staged_kv_tag(k) for k in view.used_kv_block_keys],
            "kv_quant_error_energy": [view.kv_quant_error_energy(b.key) for b in blocks],
            "io_snapshot": view.io_snapshot(),
            "prefix_entry": [view.prefix_entry(r) for r in view.kv_request_ids],
        }
        assert set(answers) == MEMBERS
        self.num_device_blocks += len(blocks)
        self.num_quant_copies += sum(
            b.quant_tier is not None
            for r in view.running_ids
            for b in view.off_device_kv_blocks(r, 99)
            if b.key[1] == 0
        )
        for name, value in answers.items():
            parts = value if isinstance(value, list) else [value]
            self.mutable += [m for part in parts for m in _immutable_parts(part, name)]

    def expert_action(self, miss: ExpertMiss) -> Decision:
        return self.inner.expert_action(miss)

    def kv_action(self, miss: KVMiss) -> Decision:
        return self.inner.kv_action(miss)

    def choose_victims(
        self, num_bytes: int, view: ControllerView, pinned_experts: set, pinned_kv: set
    ) -> Iterable[Victim]:
        self.probe(view)
        return self.inner.choose_victims(num_bytes, view, pinned_experts, pinned_kv)

    def on_step_start(self, plan: StepPlan, view: ControllerView) -> None:
        self.probe(view)
        self.inner.on_step_start(plan, view)

    def on_step_end(self, view: ControllerView) -> StepEndActions:
        self.probe(view)
        return self.inner.on_step_end(view)


@pytest.fixture(scope="module")
def probed_engine(checkpoint_factory) -> tuple[Engine, ViewProbe]:
    """A tight budget with quantized KV spills: experts, blocks and quantized copies all come and go."""
    path = checkpoint_factory("qwen3_moe")
    expert, block, layers, _ = sizes(path)
    probe = ViewProbe(ExactLRUController(force=[Tag.KV_DEQUANT]))
    budget = 4 * expert + 10 * layers * block
    config = EngineConfig(model_dir=str(path), block_size=4, max_num_seqs=3, device_budget_bytes=budget)
    engine = Engine(config, probe)
    rng = random.Random(0)
    for i in range(3):
        prompt = [rng.randrange(3, 300) for _ in range(11)]
        engine.add_request(prompt, SamplingParams(max_new_tokens=5), f"r{i}", "default")
    while engine.has_unfinished():
        engine.step()
    yield engine, probe
    engine.close()


def test_a_live_view_answers_only_with_immutable_values(probed_engine) -> None:
    engine, probe = probed_engine
    assert probe.num_probes > 10 and probe.num_device_blocks and probe.num_quant_copies
    assert probe.mutable == []


def test_a_live_view_exposes_no_store(probed_engine) -> None:
    engine, _ = probed_engine
    view = engine.view()
    assert not hasattr(view, "__dict__")  # slots only: nothing can be attached or found by name
    public = {name for name in dir(view) if not name.startswith("_")}
    assert public == MEMBERS
    for name in public:
        member = getattr(view, name)
        assert callable(member) or not list(_immutable_parts(member, name)), name
    for inner in (engine.expert_store, engine.kv_store, engine.scheduler, engine.executor, engine.sequences):
        assert all(getattr(view, name) is not inner for name in public)


def test_a_snapshot_does_not_follow_or_change_the_engine(probed_engine) -> None:
    engine, _ = probed_engine
    view = engine.view()
    block = KVBlockInfo(("r", 0, 0), 4, Tier.HOST, Tier.HOST, 8, 64)
    with pytest.raises(AttributeError):
        block.exact_tier = Tier.DEVICE  # type: ignore[misc]
    keys = view.device_expert_keys()
    with pytest.raises((TypeError, AttributeError)):
        keys.append((0, 0))  # type: ignore[attr-defined]
    assert view.device_expert_keys() == tuple(engine.expert_store.device_keys())


def _view(**fields: Any) -> StaticView:
    blocks = (
        KVBlockInfo(("r0", 0, 0), 16, Tier.DEVICE, None),
        KVBlockInfo(("r0", 0, 1), 16, Tier.HOST, Tier.HOST, 8, 4096),
        KVBlockInfo(("idle", 0, 0), 16, Tier.DEVICE, None),
    )
    base: dict[str, Any] = {
        "request_classes": {"r0": "c"},
        "running_ids": ("r0",),
        "used_expert_keys": ((0, 1), (1, 2)),
        "used_kv_block_keys": (("r0", 0, 1),),
        "deferred_expert_keys": ((1, 3),),
        "device_budget_bytes": 8 << 20,
        "device_free_bytes": 0,
        "device_bytes_by_kind": {ObjectKind.EXPERT: 6 << 20, ObjectKind.KV_BLOCK: 2 << 20},
        "bytes_per_expert": 1 << 20,
        "num_expert_params": (1 << 20) // 4,
        "on_device_experts": ((0, 1), (1, 2), (0, 5)),
        "num_layers": 2,
        "bytes_per_kv_block": 64 << 10,
        "kv_blocks": blocks,
        "kv_tokens": {"r0": 32, "idle": 16},
        "staged_kv_tags": {("r0", 0, 1): Tag.EXACT_LOAD},
        "quant_error_energies": {("r0", 0, 1): 1e-3},
        "quantized_copy_bytes": {(ObjectKind.KV_BLOCK, 8): 4096, (ObjectKind.EXPERT, 8): (1 << 18) + 16384},
    }
    return StaticView(CPU_BOX, **(base | fields))


def test_controllers_run_against_a_view_without_an_engine() -> None:
    limits = {"max_mean_kl": 1.0, "max_p99_kl": 1.0, "max_approx_fraction": 1.0, "min_top1_agreement": 0.0}
    budget = QualityBudget(allowed_tags=["kv_dequant"], **limits)
    policy = Policy(classes={"c": RequestClass(slo=SLO(tpot_ms=50.0), budget=budget)}, default_class="c")
    view = _view()
    joint = JointController(policy, top_k=2)
    joint.on_step_start(StepPlan(1, StepKind.DECODE, ["r0"], {"r0": 1}, {"r0": 32}), view)
    kv = joint.kv_action(KVMiss(1, "r0", "c", 0, 1, None, Tier.HOST, 8, view.bytes_per_kv_block))
    assert kv.tag is Tag.KV_DEQUANT and kv.predicted_cost == pytest.approx(joint.cost.kv_cost(0, 1e-3))
    expert = joint.expert_action(ExpertMiss(1, "r0", "c", 1, 3, 1, 0.2, Tier.HOST, view.bytes_per_expert, False, False))
    assert expert.tag is Tag.EXACT_LOAD
    victims = list(joint.choose_victims(1 << 20, view, set(), set()))
    assert {v.expert_key for v in victims if v.expert_key} == {(0, 1), (1, 2), (0, 5)}
    assert {v.kv_block_key for v in victims if v.kv_block_key} == {("r0", 0, 0), ("idle", 0, 0)}
    assert isinstance(joint.on_step_end(view), StepEndActions)
    lru = ExactLRUController()
    lru.on_step_end(view)
    first = next(iter(lru.choose_victims(1 << 20, view, set(), set())))
    assert first.expert_key == (0, 5)  # never used: least recently used of all
    split = StaticSplitController(0.5)
    evicted = split.on_step_end(view).evict_experts  # experts hold 6 of the 8 MiB, their share is 4
    assert evicted == [(0, 5), (0, 1)]


def test_controller_hooks_take_the_protocol() -> None:
    for name in ("choose_victims", "on_step_start", "on_step_end", "choose_read_ahead"):
        assert inspect.signature(getattr(Controller, name)).parameters["view"].annotation == "ControllerView"

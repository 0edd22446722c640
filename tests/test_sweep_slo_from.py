"""``fallbackgate sweep --slo-from``: a rerun of some controllers measured against an earlier part's SLO
targets (no reference run of its own), refused with what differs where the grid is not the same."""

from __future__ import annotations

import json
import pathlib
from types import SimpleNamespace

import pytest

from fallbackgate.sweep import regime
from fallbackgate.sweep.inputs import earlier_references
from fallbackgate.sweep.regime import RegimeConfig, SweepInputError
from fallbackgate.sweep.workload import BEST_EFFORT, STRICT
from tests.test_sweep_merge import CONFIG

GEOMETRY = {"expert_bytes": 100, "block_size": 16, "num_layers": 5, "bytes_per_kv_block": 8192}
TARGETS = {"slo_tpot_ms": [8.0, 16.0], "slo_ttft_ms": [20.0, 40.0], "geometry": GEOMETRY}


def test_slo_from_takes_one_parts_targets_for_the_same_grid(tmp_path: pathlib.Path) -> None:
    cfg = RegimeConfig(**{k: v for k, v in CONFIG.items() if k != "controllers"}, controllers=("joint",), seeds=(0, 1))
    earlier = tmp_path / "sweep.json"
    earlier.write_text(json.dumps({"config": CONFIG | {"seeds": [0, 1]}, "slo_references": {"short-chat": TARGETS}}))
    assert earlier_references(cfg, earlier) == {"short-chat": TARGETS}
    earlier.write_text(json.dumps({"config": CONFIG | {"time_scale": 1.0}, "slo_references": {"short-chat": TARGETS}}))
    with pytest.raises(ValueError, match="its time_scale is 1.0, this one's 0.25"):
        earlier_references(cfg, earlier)
    earlier.write_text(json.dumps({"config": CONFIG, "slo_references_by_source": {}}))
    with pytest.raises(ValueError, match="give a part's"):
        earlier_references(cfg, earlier)
    earlier.write_text(json.dumps({"config": CONFIG, "slo_references": {"mixed": TARGETS}}))
    with pytest.raises(ValueError, match=r"no SLO reference for \['short-chat'\]"):
        earlier_references(cfg, earlier)


def test_a_reused_reference_gives_each_class_the_earlier_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    closed = []
    built = SimpleNamespace(engine=SimpleNamespace(close=lambda: closed.append(True)))
    monkeypatch.setattr(regime, "geometry", lambda _: dict(GEOMETRY))
    cfg = RegimeConfig(model_dir="m", slo_from={"short-chat": TARGETS})
    policy, info = regime._reused_policy(cfg, "short-chat", built)  # noqa: SLF001 - what sweep_policy returns
    strict, best = policy.classes[STRICT].slo, policy.classes[BEST_EFFORT].slo
    assert (strict.tpot_ms, strict.ttft_ms, best.tpot_ms, best.ttft_ms) == (8.0, 20.0, 16.0, 40.0)
    assert info == {**TARGETS, "reused": True} and closed == [True]
    monkeypatch.setattr(regime, "geometry", lambda _: {**GEOMETRY, "num_layers": 6})
    with pytest.raises(SweepInputError, match="geometry"):
        regime._reused_policy(cfg, "short-chat", built)  # noqa: SLF001
    with pytest.raises(SweepInputError, match="no 'mixed' reference"):
        regime._reused_policy(cfg, "mixed", built)  # noqa: SLF001


def test_a_reused_reference_keeps_the_sweeps_controller_settings_and_class_budgets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--slo-from builds the same policy as a sweep with its own reference run, but for the targets."""
    built = SimpleNamespace(engine=SimpleNamespace(close=lambda: None))
    monkeypatch.setattr(regime, "geometry", lambda _: dict(GEOMETRY))
    budgets = {BEST_EFFORT: {"min_top1_agreement": 0.0}, STRICT: {"allowed_tags": ["recompute", "expert_lowbit"]}}
    cfg = RegimeConfig(
        model_dir="m",
        slo_from={"short-chat": TARGETS},
        step_time="measured",
        expert_admission="lowbit_colder",
        class_budgets=budgets,
    )
    policy, _ = regime._reused_policy(cfg, "short-chat", built)  # noqa: SLF001
    controller = policy.controller
    assert (controller.step_time.value, controller.expert_admission.value) == ("measured", "lowbit_colder")
    assert policy.classes[BEST_EFFORT].budget.min_top1_agreement == 0.0
    assert policy.classes[BEST_EFFORT].budget.max_approx_fraction == 0.3  # a field not given keeps the sweep's
    assert policy.classes[STRICT].budget.allowed_tags == ["recompute", "expert_lowbit"]

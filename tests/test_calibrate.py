"""Calibration: the fit on hand numbers, and a real run's ledger → stored scales that later runs load."""

from __future__ import annotations

import pathlib

import pytest

from fallbackgate.batch.session import RunSettings
from fallbackgate.cli import main
from fallbackgate.controllers import make_controller
from fallbackgate.controllers.cost import DEFAULT_SCALES, fit, load_calibration, weighted_quantile
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.tags import Tag
from fallbackgate.ledger.db import open_ledger
from fallbackgate.policy.schema import SLO, Policy, QualityBudget, RequestClass
from fallbackgate.recording import record_and_judge
from tests.test_controllers_engine import SLOW
from tests.test_engine_exact import sizes


def test_weighted_quantile() -> None:
    assert weighted_quantile([3.0, 1.0, 2.0], [1.0, 1.0, 1.0], 0.5) == 2.0
    assert weighted_quantile([1.0, 10.0], [0.9, 0.1], 0.9) == 1.0
    assert weighted_quantile([1.0, 10.0], [0.9, 0.1], 0.95) == 10.0


def test_fit_attributes_by_predicted_share() -> None:
    samples = [
        {"run_id": 1, "measured": 0.2, "predicted": {("expert_defer", 0): 0.1}},  # ratio 2
        {"run_id": 1, "measured": 0.1, "predicted": {("expert_defer", 0): 0.05, ("kv_dequant", 1): 0.05}},  # 1
    ]
    fitted = fit(samples, 1.0)
    assert fitted[("expert_defer", 0)] == (2.0, 2)
    assert fitted[("kv_dequant", 1)] == (1.0, 1)


def test_calibrate_from_a_real_run(checkpoint_factory, tmp_path: pathlib.Path, capsys) -> None:
    path = checkpoint_factory("qwen3_moe")
    expert, block, layers, top_k = sizes(path)
    budget = QualityBudget(
        max_mean_kl=0.5, max_p99_kl=2.0, max_approx_fraction=0.5, allowed_tags=["expert_defer"], min_top1_agreement=0
    )
    policy = Policy(classes={"be": RequestClass(slo=SLO(tpot_ms=0.05), budget=budget)}, default_class="be")
    engine = Engine(
        EngineConfig(
            model_dir=str(path),
            block_size=4,
            max_num_seqs=3,
            device_budget_bytes=4 * expert + 10 * layers * block,
            profile=SLOW,
        ),
        make_controller("joint", policy, top_k=top_k),
    )
    from fallbackgate.batch.prompts import PromptSpec

    specs = [PromptSpec(f"the quick brown fox {i}", f"p{i}", "be") for i in range(3)]
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    recorded = record_and_judge(engine, specs, url, settings=RunSettings(model_dir=str(path), max_new_tokens=6))
    assert recorded.num_audited == 3
    assert main(["calibrate", "--ledger", url]) == 0
    assert "expert_defer" in capsys.readouterr().out
    with open_ledger(url) as ledger:
        model = load_calibration(ledger)
    fitted = {k: v for k, v in model.scales.items() if k[0] is Tag.EXPERT_DEFER}
    assert fitted and all(v > 0 for v in fitted.values())
    assert any(v != pytest.approx(DEFAULT_SCALES[Tag.EXPERT_DEFER]) for v in fitted.values())


def test_calibrate_with_nothing_to_fit(tmp_path: pathlib.Path) -> None:
    open_ledger(str(tmp_path / "empty.sqlite")).close()  # an empty ledger (calibrate never creates one)
    assert main(["calibrate", "--ledger", f"sqlite:///{tmp_path / 'empty.sqlite'}"]) == 1

"""`fallbackgate plan`: fit, memory split and predictions from config and safetensors headers only."""

from __future__ import annotations

import json
import pathlib

import pytest

import fallbackgate
from fallbackgate.cli import main
from fallbackgate.engine.config import TierLayout
from fallbackgate.engine.hardware import CPU_BOX
from fallbackgate.planning.plan import Workload, _unique, make_plan
from fallbackgate.planning.shape import model_shape
from fallbackgate.tinymoe import CHECKPOINT_DIR
from tests.checkpoints import make_checkpoint
from tests.test_engine_exact import sizes


def test_shape_from_headers_matches_the_engine_s_accounting(tmp_path: pathlib.Path) -> None:
    path = make_checkpoint("qwen3_moe", tmp_path / "m", seed=0)
    expert, block, layers, top_k = sizes(path)
    shape = model_shape(path)
    assert (shape.expert_bytes, shape.num_moe_layers, shape.top_k) == (expert, layers, top_k)
    assert shape.kv_bytes_per_token * 4 == block  # one 4-token block of one layer, as the engine sizes it
    bundled = model_shape(CHECKPOINT_DIR)
    assert (bundled.num_layers, bundled.num_moe_layers, bundled.num_experts, bundled.top_k) == (5, 4, 16, 2)


def test_fit_split_and_monotone_predictions() -> None:
    shape = model_shape(CHECKPOINT_DIR)
    everything = make_plan(shape, CPU_BOX, Workload(64, 4, None, None))
    assert everything.fits and everything.hit_rate == 1.0 and everything.num_expert_slots == shape.num_experts_total
    floor = shape.top_k * shape.expert_bytes
    tight = make_plan(shape, CPU_BOX, Workload(64, 4, everything.kv_bytes + floor + shape.expert_bytes, 0))
    assert tight.fits and tight.num_expert_slots == shape.top_k + 1 and tight.hit_rate < 1.0
    assert tight.tpot_ms > everything.tpot_ms  # misses cost transfers
    too_small = make_plan(shape, CPU_BOX, Workload(64, 4, everything.kv_bytes + floor // 2, 0))
    assert not too_small.fits and "floor" in too_small.reason
    longer = make_plan(shape, CPU_BOX, Workload(1024, 4, None, None))
    assert longer.kv_bytes > everything.kv_bytes and longer.ttft_ms > everything.ttft_ms


def test_classes_get_the_fallback_their_slo_needs() -> None:
    shape = model_shape(CHECKPOINT_DIR)
    kv = make_plan(shape, CPU_BOX, Workload(64, 4, None, None)).kv_bytes
    w = Workload(64, 4, kv + (shape.top_k + 1) * shape.expert_bytes, 0)
    exact = make_plan(shape, CPU_BOX, w).tpot_ms
    classes = {
        "loose": {"slo": {"tpot_ms": 10 * exact}, "budget": {}},
        "tight": {"slo": {"tpot_ms": 0.9 * exact}, "budget": {"max_mean_kl": 0.1}},
        "exact-only": {"slo": {"tpot_ms": 0.001}, "budget": {"allowed_tags": []}},
    }
    plan = make_plan(shape, CPU_BOX, w, classes)
    by = {c.name: c for c in plan.classes}
    assert by["loose"].is_met_exactly and by["loose"].fallback is None
    assert by["tight"].is_met and by["tight"].fallback is not None and by["tight"].predicted_tpot_ms <= 0.9 * exact
    assert not by["exact-only"].is_met and by["exact-only"].fallback == "cpu_execute"  # no approximate tag allowed


def test_plan_command(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "--context", "64", "--concurrency", "4", "--json", str(out)]) == 0
    assert "fits" in capsys.readouterr().out and json.loads(out.read_text())["fits"] is True
    assert main(["plan", "--context", "64", "--concurrency", "4", "--device-budget-mb", "0.5"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert main(["plan", "--context", "0", "--concurrency", "4"]) == 2
    assert "--context must be >= 1" in capsys.readouterr().err
    assert main(["plan", "--model", str(tmp_path), "--context", "8", "--concurrency", "1"]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_routing_exponent_from_recorded_runs(tmp_path: pathlib.Path) -> None:
    from fallbackgate.controllers.exact_lru import ExactLRUController
    from fallbackgate.engine.config import EngineConfig
    from fallbackgate.engine.engine import Engine
    from fallbackgate.ledger.db import open_ledger
    from fallbackgate.planning.history import routing_exponent, step_start_hit
    from fallbackgate.recording import record_and_judge

    assert step_start_hit(1.0, 10, 20) == 1.0 and step_start_hit(0.5, 10, 20) == 0.0  # every use a miss
    path = make_checkpoint("qwen3_moe", tmp_path / "m", seed=0)
    expert, block, layers, _ = sizes(path)
    engine = Engine(
        EngineConfig(model_dir=str(path), block_size=4, device_budget_bytes=6 * expert + 40 * layers * block),
        ExactLRUController(),
    )
    url = str(tmp_path / "l.sqlite")
    prompts = ["once upon a time", "the quick brown fox jumps", "a princess lived in a castle"]
    recorded = record_and_judge(engine, prompts, url)
    shape = model_shape(path)
    with open_ledger(url) as ledger:
        alpha = routing_exponent(ledger, shape)
        assert routing_exponent(ledger, shape, exclude_run_ids={recorded.run_id}) is None
    assert alpha is not None and 0.0 < alpha < 5.0


def test_a_cpu_plan_has_ram_and_disk_only_and_says_why() -> None:
    """On a CPU a miss is one disk read into RAM, no class is offered cpu_execute, and a host budget is refused."""
    shape = model_shape(CHECKPOINT_DIR)
    kv = make_plan(shape, CPU_BOX, Workload(64, 4, None, None)).kv_bytes
    budget = kv + (shape.top_k + 1) * shape.expert_bytes
    cuda = make_plan(shape, CPU_BOX, Workload(64, 4, budget, 0))
    cpu = make_plan(shape, CPU_BOX, Workload(64, 4, budget, None, layout=TierLayout.RAM_DISK))
    assert (cpu.home, cpu.tier_layout, cuda.tier_layout) == ("disk", "ram_disk", "device_host_disk")
    assert "no host tier" in cpu.tier_note and "no cpu_execute" in cpu.tier_note and cuda.tier_note == ""
    pcie_s = shape.expert_bytes / CPU_BOX.host_to_device_bytes_per_s  # the leg a CPU's disk read does not take
    misses = shape.num_moe_layers * _unique(shape, 4) * (1.0 - cpu.num_expert_slots / cpu.num_experts_total)
    assert cuda.tpot_ms - cpu.tpot_ms == pytest.approx(1e3 * misses * pcie_s, rel=1e-6)
    classes = {
        "any": {"slo": {"tpot_ms": 0.001}, "budget": {}},
        "exact-only": {"slo": {"tpot_ms": 0.001}, "budget": {"allowed_tags": []}},
    }
    on_cpu = make_plan(shape, CPU_BOX, Workload(64, 4, budget, None, layout=TierLayout.RAM_DISK), classes)
    by = {c.name: c for c in on_cpu.classes}
    assert by["any"].fallback == "expert_defer" and not by["exact-only"].is_met and by["exact-only"].fallback is None
    on_cuda = make_plan(shape, CPU_BOX, Workload(64, 4, budget, 0), classes)
    assert [c.fallback for c in on_cuda.classes] == ["expert_defer", "cpu_execute"]  # the same classes on CUDA
    with pytest.raises(ValueError, match="host budget .* not offered where the device is the CPU"):
        Workload(64, 4, budget, 1 << 20, layout=TierLayout.RAM_DISK)


def test_plan_command_on_a_cpu(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "p.yaml"
    exact = (pathlib.Path(fallbackgate.__file__).parent / "policies" / "exact.yaml").read_text()
    policy.write_text(exact.replace("tpot_ms: 50", "tpot_ms: 0.001"))  # exact only, an SLO nothing meets
    out = tmp_path / "plan.json"
    argv = ["plan", "--context", "64", "--concurrency", "4", "--device", "cpu", "--device-budget-mb", "4"]
    assert main([*argv, "--policy", str(policy), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "no host tier and no cpu_execute" in printed and "misses come from disk" in printed
    assert "no allowed fallback is offered here" in printed and "needs cpu_execute" not in printed
    assert json.loads(out.read_text())["tier_layout"] == "ram_disk"
    assert main([*argv, "--host-budget-mb", "1"]) == 2
    assert "not offered where the device is the CPU" in capsys.readouterr().err

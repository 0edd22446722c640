"""``trace simulate``: the project's controllers over a planted trace through the simulated view: counts and
stall where the answer is known, consistency of bytes with misses, parallel runs equal serial ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fallbackgate.cli import main
from fallbackgate.controllers.registry import registered_kinds
from fallbackgate.tracing import TraceWriter
from fallbackgate.tracing.devices import DeviceModel
from fallbackgate.tracing.reader import read_trace
from fallbackgate.tracing.schema import TraceTable
from fallbackgate.tracing.simulate import SimulationConfig
from fallbackgate.tracing.simulate_run import Simulator, _device_groups, _load, _run_group, load_input, simulate_many
from fallbackgate.tracing.synthetic import Planted, write_planted_trace
from fallbackgate.tracing.validate import recorded_budget

DEVICE = DeviceModel("flat", 100_000, 2e9)


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Planted, str]:
    path = tmp_path_factory.mktemp("sim") / "trace"
    return write_planted_trace(path, Planted(num_steps_per_phase=20, num_layers=4, num_experts=32)), str(path)


def _room_for_everything(p: Planted) -> int:
    """Every expert, phase B's KV (the larger), phase A's blocks kept when its requests end (phase B adopts
    none: other contents) and one layer's K/V of phase B gathered for attention."""
    gathered = p.num_requests_per_phase * p.working_sets(1)[1] * p.bytes_per_kv_block
    return int(1.75 * p.total_budget_bytes) + gathered


def test_room_for_everything_leaves_only_cold_expert_misses(planted: tuple) -> None:
    p, path = planted
    configs = [SimulationConfig(k.value, _room_for_everything(p), DEVICE) for k in registered_kinds()]
    cold = p.num_layers * p.working_sets(0)[0]  # phase B's experts are a subset of phase A's
    for result in simulate_many(path, configs, jobs=1):
        assert "error" not in result, result
        assert result["misses_by_tag"] == {"expert:exact_load": cold}, result["controller"]
        assert result["stall_s"] == pytest.approx(cold * DEVICE.read_ns(p.bytes_per_expert) / 1e9)
        # phase A's requests wait for the cold loads over their steps; phase B's never wait
        tpot_a_ns = p.compute_ns + cold * DEVICE.read_ns(p.bytes_per_expert) / p.num_steps_per_phase
        assert result["slo_attainment"] == (int(tpot_a_ns <= p.slo_tpot_ns) + 1) / 2


def test_a_layers_gathered_kv_takes_room_from_experts(planted: tuple) -> None:
    """A full budget: a layer's gathered K/V (a request's blocks when it has more than one, a one-block request's
    block when it was read from off device) evicts experts for its room."""
    p, path = planted
    simulator = Simulator(load_input(path), SimulationConfig("exact_lru", 10 * p.bytes_per_expert, DEVICE))
    view = simulator.view
    view.experts = dict.fromkeys((0, e) for e in range(10))
    simulator.gather([("r", 0, 0)], set(), set())  # one resident block: read in place
    assert len(view.experts) == 10
    simulator.gather([("r", 0, 0)], {("r", 0, 0)}, set())  # one block read from off device: staged
    assert len(view.experts) == 9
    keys = [("r", 0, b) for b in range(5)] + [("s", 0, 0)]  # 5 blocks of r, 1 of s: r's 5 are gathered
    view.experts = dict.fromkeys((0, e) for e in range(10))
    simulator.gather(keys, set(), set(keys))
    assert len(view.experts) == 10 - -(-5 * p.bytes_per_kv_block // p.bytes_per_expert)


def test_small_budgets_miss_and_move_the_bytes_they_say(planted: tuple) -> None:
    p, path = planted
    configs = [SimulationConfig(k.value, p.total_budget_bytes // 2, DEVICE, 0.5) for k in registered_kinds()]
    serial = simulate_many(path, configs, jobs=1)
    for result in serial:
        assert "error" not in result, result
        loads = result["misses_by_tag"]
        moved = result["bytes_by_tag"]
        assert loads.get("kv:exact_load", 0) > 0 and result["slo_attainment"] < 1.0
        assert moved["expert:exact_load"] == loads["expert:exact_load"] * p.bytes_per_expert
        assert moved.get("kv:exact_load", 0) == loads.get("kv:exact_load", 0) * p.bytes_per_kv_block
        assert result["stall_s"] > 0.5 * p.num_layers * p.working_sets(0)[0] * DEVICE.read_ns(p.bytes_per_expert) / 1e9
    assert simulate_many(path, configs, jobs=2) == serial  # processes give the same results


def test_cli_writes_one_result_per_configuration(planted: tuple, tmp_path: Path) -> None:
    _, path = planted
    out = tmp_path / "sim.json"
    args = ["trace", "simulate", path, "--out", str(out), "--controllers", "exact_lru,static_split"]
    assert (
        main([*args, "--budget-gib", "1,2", "--expert-fractions", "0.25,0.75", "--devices", "nvme", "--jobs", "1"]) == 0
    )
    results = json.loads(out.read_text())
    assert [(r["controller"], r["budget_gib"], r["expert_fraction"]) for r in results] == [
        ("exact_lru", 1.0, None), ("exact_lru", 2.0, None), ("static_split", 1.0, 0.25), ("static_split", 1.0, 0.75),
        ("static_split", 2.0, 0.25), ("static_split", 2.0, 0.75),
    ]  # fmt: skip
    assert {r["device"] for r in results} == {"nvme-pcie4 (what-if)"}
    assert main(["trace", "simulate", path, "--out", str(out), "--controllers", "nope"]) == 2


def test_one_decision_pass_per_device_group_equals_one_run_per_configuration(
    planted: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A profile-free controller's decisions are made once per device group and priced on each device; one
    that reads the profile (joint) decides once per configuration; every result equals its own run."""
    p, path = planted
    devices = [DEVICE, DeviceModel("slow-link (test)", latency_ns=2_000_000.0, bandwidth_bytes_per_s=50e6)]
    configs = [
        SimulationConfig(k.value, p.total_budget_bytes // 3, d, 0.4) for k in registered_kinds() for d in devices
    ]
    alone = [Simulator(load_input(path), c).run() for c in configs]
    passes: list[str] = []
    decide = Simulator.decide
    monkeypatch.setattr(Simulator, "decide", lambda self, *a: passes.append(self.config.controller) or decide(self, *a))
    _load(path)
    grouped = [r for group in _device_groups(configs) for r in _run_group([configs[i] for i in group])]
    assert [g for g in grouped if "error" in g] == []
    assert grouped == alone
    assert alone[0]["stall_s"] != alone[1]["stall_s"]  # the devices price the same decisions differently
    assert sorted(passes) == ["exact_lru", "independent_lru", "joint", "joint", "static_split"]


def test_simulating_a_recorded_joint_run_makes_the_misses_it_made(tmp_path: Path) -> None:
    """The bundled model's built-in prompts under joint at 2.5 MiB: the run keeps every KV block in RAM (a
    new block's room is made before the forward, from experts; an expert's room never comes from KV; a
    prefetch only fills free room) and the simulation of its own configuration must too. Before, the
    simulator made a block's room during the layer's forward, with the step's experts pinned, so blocks went
    straight to the host and were read back: 558 KV loads the run never made, stall +59 %."""
    trace = tmp_path / "t"
    args = ["run", "--controller", "joint", "--device-budget-mb", "2.5", "--trace", str(trace), "--quiet"]
    assert main([*args, "--ledger", str(tmp_path / "l.sqlite"), "--audit-rate", "0.01"]) == 0
    recorded = read_trace(str(trace))
    kv, experts = (recorded.frame(t) for t in (TraceTable.KV_ACCESS, TraceTable.EXPERT_ACCESS))
    recorded_kv_loads = int((kv["tag"] == "exact_load").sum())
    recorded_expert_loads = int((experts["tag"] == "exact_load").sum())
    config = SimulationConfig("joint", recorded_budget(recorded), DEVICE)
    (result,) = simulate_many(str(trace), [config], jobs=1)
    assert "error" not in result, result
    assert result["misses_by_tag"].get("kv:exact_load", 0) <= recorded_kv_loads + 8, result["misses_by_tag"]
    simulated = result["misses_by_tag"]["expert:exact_load"]
    assert 0.5 * recorded_expert_loads <= simulated <= 1.25 * recorded_expert_loads, (simulated, recorded_expert_loads)


def test_only_the_layers_own_experts_are_pinned_while_it_loads(tmp_path: Path) -> None:
    """Room for one expert (and a's one KV block), layers 0 and 1 each using their expert 0 in two steps: as in
    the engine, layer 1's load may evict layer 0's expert (the step's other layers are not pinned), so every use
    misses."""
    model = {"num_layers": 2, "num_experts": 1, "top_k": 1, "bytes_per_expert": 1000, "bytes_per_kv_block": 100}
    uses = [(step, layer) for step in (0, 1) for layer in (0, 1)]
    with TraceWriter(tmp_path / "t", {"model": model}) as writer:
        writer.append(TraceTable.STEPS, step=[0, 1], phase=["decode"] * 2, start_ns=[0, 10**6],
                      end_ns=[9 * 10**5, 19 * 10**5], batch=[1, 1], tokens=[1, 1])  # fmt: skip
        writer.append(TraceTable.EXPERT_ACCESS, step=[s for s, _ in uses], request=["a"] * 4,
                      layer=[layer for _, layer in uses], expert=[0] * 4, router_rank=[0] * 4, router_weight=[1.0] * 4,
                      tier_before=["disk"] * 4, tag=["exact_load"] * 4, bytes=[1000] * 4, ns=[10**5] * 4,
                      is_predicted=[False] * 4)  # fmt: skip
        writer.append(TraceTable.KV_ACCESS, step=[0, 1], request=["a"] * 2, layer=[0, 0], block=[0, 0],
                      content_hash=None, tier_before=["device"] * 2, tag=["resident"] * 2, bytes=[0, 0],
                      ns=[0, 0])  # fmt: skip
        writer.append(TraceTable.REQUESTS, request=["a"], request_class=["x"], slo_ttft_ns=None,
                      slo_tpot_ns=[None], arrival_ns=[0], first_token_ns=[None], finish_ns=[None], prompt_tokens=[1],
                      output_tokens=[1])  # fmt: skip
    result = simulate_many(str(tmp_path / "t"), [SimulationConfig("exact_lru", 1100, DEVICE)], jobs=1)[0]
    assert result["misses_by_tag"] == {"expert:exact_load": 4}

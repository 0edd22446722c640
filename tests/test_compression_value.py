"""``bench.compression_value`` and the simulator's compression what-if: budgets under both regimes, savings and
their paired change against the uncompressed model, and objects that occupy and move the scaled bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fallbackgate.bench.compression_value import (
    BASE,
    SAME_BYTES,
    SAME_PRESSURE,
    VARIANTS,
    budget_bytes,
    plan,
    plot_savings,
    report_lines,
    simulate_cell,
    summarize,
)
from fallbackgate.bench.devices_flip import controllers
from fallbackgate.cli import main
from fallbackgate.engine.io.direct import ALIGN
from fallbackgate.tracing import realio
from fallbackgate.tracing.devices import DeviceModel
from fallbackgate.tracing.reader import read_trace
from fallbackgate.tracing.realio import RealIO, run_real
from fallbackgate.tracing.simulate import SimulationConfig
from fallbackgate.tracing.simulate_input import load_input
from fallbackgate.tracing.simulate_run import simulate_many
from fallbackgate.tracing.simulator import Simulator
from fallbackgate.tracing.synthetic import Planted, write_planted_trace
from fallbackgate.tracing.validate import recorded_budget

DEVICE = DeviceModel("flat", 100_000, 2e9)


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Planted, str]:
    path = tmp_path_factory.mktemp("compress") / "trace"
    return write_planted_trace(path, Planted(num_steps_per_phase=20, num_layers=4, num_experts=32)), str(path)


def test_same_pressure_scales_the_budget_as_the_demand() -> None:
    point = {"demand_bytes": 1000, "kv_demand_bytes": 200}  # 800 expert bytes, 200 KV
    assert budget_bytes(point, 250, (0.5, 1.0), SAME_BYTES) == 250
    assert budget_bytes(point, 250, (0.5, 1.0), SAME_PRESSURE) == int(250 * (400 + 200) / 1000)
    assert budget_bytes(point, 250, (1.0, 0.5), SAME_PRESSURE) == int(250 * (800 + 100) / 1000)
    assert budget_bytes(point, 250, (1.0, 1.0), SAME_PRESSURE) == 250


def test_compressed_objects_occupy_and_move_their_scaled_bytes(planted: tuple) -> None:
    p, path = planted
    budget = p.total_budget_bytes // 2
    plain, halved = simulate_many(path, [SimulationConfig("independent_lru", budget, DEVICE),
                                         SimulationConfig("independent_lru", budget, DEVICE, None, 0.5, 0.5)],
                                  jobs=1)  # fmt: skip
    for result, scale in ((plain, 1.0), (halved, 0.5)):
        loads, moved = result["misses_by_tag"], result["bytes_by_tag"]
        assert moved["expert:exact_load"] == loads["expert:exact_load"] * int(p.bytes_per_expert * scale)
        assert moved.get("kv:exact_load", 0) == loads.get("kv:exact_load", 0) * int(p.bytes_per_kv_block * scale)
    assert (halved["expert_bytes_scale"], halved["kv_bytes_scale"]) == (0.5, 0.5)
    assert halved["expert_hits"] > plain["expert_hits"]  # twice as many fit in the same room
    assert halved["stall_s"] < plain["stall_s"]
    unstalled = [r["run_s"] - r["stall_s"] for r in (plain, halved)]
    assert unstalled[1] == pytest.approx(unstalled[0])  # compute and host time as recorded
    assert plain["run_s"] > plain["stall_s"] > 0
    with_room_halved = simulate_many(path, [SimulationConfig("independent_lru", budget // 2, DEVICE, None, 0.5, 0.5)],
                                     jobs=1)[0]  # fmt: skip
    assert with_room_halved["misses_by_tag"] == plain["misses_by_tag"]  # the same objects fit: the same misses
    bad = simulate_many(path, [SimulationConfig("independent_lru", budget, DEVICE, None, 0.0, 1.0)], jobs=1)[0]
    assert "bytes scales must be in (0, 1]" in bad["error"]


def test_cli_compress_adds_variants_and_refuses_bad_fractions(
    planted: tuple, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, path = planted
    out = tmp_path / "sim.json"
    args = ["trace", "simulate", path, "--out", str(out), "--controllers", "exact_lru", "--devices", "nvme"]
    assert main([*args, "--compress", "1:1,0.5:1", "--jobs", "1"]) == 0
    results = json.loads(out.read_text())
    assert [(r["expert_bytes_scale"], r["kv_bytes_scale"]) for r in results] == [(1.0, 1.0), (0.5, 1.0)]
    assert main([*args, "--compress", "1:4", "--jobs", "1"]) == 0  # a larger KV: 4 times the bytes per block
    assert [r["kv_bytes_scale"] for r in json.loads(out.read_text())] == [4.0]
    for bad in ("2:1", "1:65", "half", "0:1"):
        with pytest.raises(SystemExit):
            main([*args, "--compress", bad])
    assert "fractions must be in (0, 1] (KV: (0, 64]" in capsys.readouterr().err
    for bad, why in (("1,x", "expected comma-separated numbers, got '1,x'"), ("0.5,0", "numbers must be > 0")):
        with pytest.raises(SystemExit):
            main([*args, "--budget-gib", bad])
        assert why in capsys.readouterr().err


@pytest.mark.parametrize("scales", [(0.5, 1.0), (1.0, 4.0)], ids=["experts-halved", "kv-4x"])
def test_real_io_moves_the_what_if_sizes(
    scales: tuple[float, float], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = tmp_path / "trace"
    p = Planted(num_steps_per_phase=10, num_layers=3, num_experts=16, bytes_per_expert=32 * 1024,
                bytes_per_kv_block=8 * 1024, total_budget_bytes=1 << 20)  # fmt: skip
    write_planted_trace(trace, p)
    config = SimulationConfig("exact_lru", p.total_budget_bytes, DEVICE, None, *scales)
    simulator = Simulator(load_input(str(trace)), config)
    simulator.decide(is_recording=True)
    ops = [op for step in simulator.ops for op in step]
    sizes = {"expert": int(p.bytes_per_expert * scales[0]), "kv_block": int(p.bytes_per_kv_block * scales[1])}
    assert {op.num_bytes for op in ops if op.op == "write"} == {sizes["kv_block"]}  # spills: whole blocks
    assert {op.num_bytes for op in ops if op.kind == "expert"} == {sizes["expert"]}
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    layouts: list[realio.ScratchLayout] = []
    make_layout = realio.ScratchLayout

    def kept_layout(*args):
        layouts.append(make_layout(*args))
        return layouts[-1]

    monkeypatch.setattr(realio, "ScratchLayout", kept_layout)
    result = run_real(load_input(str(trace)), config, str(trace), RealIO(str(scratch), 1, False))
    assert result["num_reads"] + result["num_writes"] == len(ops) and result["num_failed"] == 0
    extents = {(op.kind, op.key): layouts[0].place(op) for op in ops if op.num_bytes == sizes[op.kind]}
    ends = sorted((offset, offset + n) for offset, n in extents.values())
    assert all(end <= start for (_, end), (start, _) in zip(ends, ends[1:], strict=False))  # no two overlap
    assert ends[-1][1] <= layouts[0].size
    for key, moved in result["bytes_moved"].items():
        asked = sum(op.num_bytes for op in ops if f"{op.kind}:{op.op}" == key)
        assert asked <= moved < asked + ALIGN * sum(f"{op.kind}:{op.op}" == key for op in ops), key


def test_plan_simulates_the_recorded_model_once_and_copies_it_to_both_budgets(planted: tuple) -> None:
    p, path = planted
    trace = read_trace(path)
    recorded = int(recorded_budget(trace))
    point = {"trace": path, "demand_bytes": 4 * recorded, "kv_demand_bytes": recorded}  # 3/4 experts, 1/4 KV
    configs = plan(point, trace)
    per_device = len(controllers()) * (1 + 2 * (len(VARIANTS) - 1))
    assert len(configs) == 2 * per_device  # the trace's own waits and the NVMe what-if
    assert {r for r, v, *_ in configs if v == BASE} == {SAME_BYTES}
    budgets = {(r, v): c.budget_bytes for r, v, _, c in configs}
    assert budgets[(SAME_PRESSURE, "experts x1/2")] == int(recorded * (0.5 * 3 + 1) / 4)
    assert budgets[(SAME_BYTES, "experts x1/2")] == recorded
    cell = simulate_cell(point, jobs=1)
    for regimes in cell.values():
        assert regimes[SAME_PRESSURE][BASE] == regimes[SAME_BYTES][BASE]
        assert set(regimes[SAME_PRESSURE]) == set(VARIANTS) == set(regimes[SAME_BYTES])


def _cell(seed: int, variants: dict[str, tuple[float, float, float]]) -> dict:
    """`variants`: name -> (joint, best static, two LRUs) stalls, the same under both budgets."""

    def labels(joint: float, static: float, lru: float) -> dict:
        stalls = {"joint": joint, "two LRUs": lru, "static KV 0.1": static, "static KV 0.3": static + 1}
        return {k: {"stall_s": v, "run_s": 10.0 + v, "p99_tpot_ms": 1.0} for k, v in stalls.items()}

    regimes = {r: {n: labels(*v) for n, v in variants.items()} for r in (SAME_BYTES, SAME_PRESSURE)}
    return {"workload": "mixed", "seed": seed, "ram_frac": 0.25, "devices": {"waits": regimes}}


def test_savings_and_their_change_against_the_uncompressed_model(tmp_path: Path) -> None:
    cells = [_cell(0, {BASE: (1.0, 2.0, 4.0), "experts x1/2": (1.0, 1.0, 2.0)}),
             _cell(1, {BASE: (2.0, 4.0, 4.0), "experts x1/2": (1.0, 4.0, 2.0)})]  # fmt: skip
    summary = summarize(cells)
    base = summary["waits"][SAME_BYTES][BASE]["mixed@0.25"]
    half = summary["waits"][SAME_BYTES]["experts x1/2"]["mixed@0.25"]
    assert base["saving_vs_best static"]["mean"] == pytest.approx(0.5)
    assert half["saving_vs_best static"]["mean"] == pytest.approx((0.0 + 0.75) / 2)
    assert half["saving_change_vs_best static"]["mean"] == pytest.approx(((0.0 - 0.5) + (0.75 - 0.5)) / 2)
    # of the partner's whole run: its stall plus the 10 s every run spends unstalled
    assert base["run_saving_vs_best static"]["mean"] == pytest.approx((1 / 12 + 2 / 14) / 2)
    assert half["run_saving_change_vs_best static"]["mean"] == pytest.approx(((0 - 1 / 12) + (3 / 14 - 2 / 14)) / 2)
    assert half["run_saving_vs_two LRUs"]["mean"] == pytest.approx((1 / 12 + 1 / 12) / 2)
    assert half["stall_s"] == {"joint": 1.0, "best static": 2.5, "two LRUs": 2.0} and half["unstalled_s"] == 10.0
    assert half["stall_share_of_run"] == pytest.approx(1 / 11)
    assert "saving_change_vs_best static" not in base
    assert any("experts x1/2" in line and "mixed@0.25" in line for line in report_lines(summary))
    plot_savings(summary, str(tmp_path / "fig.png"))
    assert (tmp_path / "fig.png").stat().st_size > 10_000

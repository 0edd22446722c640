"""``bench.compression_real``: joint's value per condition (a model and its compressed copy, measured sweeps) —
gains, the pooled stall saving over each seed's least-stalling split and two LRUs, quality, whether the RAM
binds — and the change against the base's cells of the same pressure and the same bytes, paired by seed where
the requests are the same, on hand-made sweeps whose numbers are known."""

from __future__ import annotations

import json
import pathlib

import pytest

from fallbackgate.bench import compression_real as cr
from fallbackgate.sweep.intervals import welch_interval

SHARES = (0.1, 0.3, 0.5)


def _point(seed: int, frac: float, controller: str, share: float | None, tpot: float, stall: float, run_id: int,
           demand: int, basis: int, kl: float = 0.0) -> dict:  # fmt: skip
    metrics = {"slo_attainment": 0.5, "tpot_p99_ms": tpot, "read_bytes": 100.0, "stall_s": stall, "mean_kl": kl,
               "gate_passed": 1.0, "foo_lb_bytes": 50.0, "belady_expert_bytes": 60.0, "belady_kv_bytes": 0.0,
               "bytes_expert_exact_load": 100.0, "peak_pool_by_kind": {"expert": 10}}  # fmt: skip
    return {"workload": "mixed", "ram_frac": frac, "ram_bytes": int(frac * basis), "demand_bytes": demand,
            "seed": seed, "controller": controller, "kv_share": share, "run_id": run_id,
            "metrics": metrics}  # fmt: skip


def _sweep(seeds: list[int], joint_stall: dict[float, float], demand: int = 4000, joint_tpot: float = 8.0,
           held_out: int = 0, basis: int | None = None, **config: object) -> dict:  # fmt: skip
    """Static splits stall 2, 3, 4 s at 10 ms P99 TPOT, two LRUs 4 s at 10 ms; joint's stall per RAM fraction of
    `basis` (default: the condition's own `demand`)."""
    points = []
    for seed in seeds:
        for frac, stall in joint_stall.items():
            for share, static_stall in zip(SHARES, (2.0, 3.0, 4.0), strict=True):
                points.append(
                    _point(seed, frac, "static_split", share, 10.0, static_stall, len(points), demand, basis or demand)
                )
            points.append(_point(seed, frac, "independent_lru", None, 10.0, 4.0, len(points), demand, basis or demand))
            points.append(
                _point(seed, frac, "joint", None, joint_tpot, stall, len(points), demand, basis or demand, kl=1e-6)
            )
    for p in points:
        p["run_id"] += 1000 * seeds[0] + 100_000 * int(demand)
    base = {"held_out_seed": held_out, "seeds": seeds, "model_dir": "m", "workloads": ["mixed"], "mixed_requests": 8}
    refs = {"mixed": {"slo_tpot_ms": [12.0, 24.0], "slo_ttft_ms": [50.0, 100.0]}}
    return {"points": points, "config": base | config, "slo_references": refs}


def test_pooled_stall_saving_budget_and_quality_of_one_condition() -> None:
    cond = cr.load_condition_results([_sweep([0, 1], {0.25: 1.0})])
    summary = cr.summarize({"fp32": cond}, "fp32")["fp32"]
    entry = summary["cells"]["mixed@0.25"]
    assert entry["pooled_stall_saving"] == {"least-stall static": pytest.approx(0.5), "two LRUs": pytest.approx(0.75)}
    assert entry["ram_of_demand"] == pytest.approx(0.25) and entry["is_binding"] and entry["n"] == 2
    assert entry["gains"]["independent_lru"]["tpot_p99_ms"]["mean"] == pytest.approx(0.2)  # 8 against 10 ms
    assert entry["gains"]["oracle_static"]["stall_s"]["mean"] == pytest.approx(0.5)
    assert entry["joint_mean_kl"] == pytest.approx(1e-6) and entry["baseline_max_mean_kl"] == 0.0
    assert (entry["gates_passed"], entry["runs"]) == (10, 10) and "vs_base" not in entry
    assert summary["slo_targets"] == {"mixed": {"slo_tpot_ms": [12.0, 24.0], "slo_ttft_ms": [50.0, 100.0]}}


def test_a_half_size_copy_is_compared_at_the_same_pressure_and_the_same_bytes() -> None:
    """The copy's demand is half: its 0.25 cell has the base's pressure at 0.25, its 0.5 cell the base's bytes
    at 0.25 (its RAM 2000 of 2000 at 1.0 would not bind)."""
    base = cr.load_condition_results([_sweep([0, 1, 2], {0.25: 1.0, 0.5: 1.0})])
    half = cr.load_condition_results([_sweep([0, 1, 2], {0.25: 1.8, 0.5: 1.6, 1.0: 1.0}, demand=2000)])
    summary = cr.summarize({"fp32": base, "bf16": half}, "fp32")
    cells = summary["bf16"]["cells"]
    assert not cells["mixed@1.0"]["is_binding"] and cells["mixed@0.5"]["is_binding"]
    pressure = cells["mixed@0.25"]["vs_base"]["same pressure"]
    assert pressure["base_cell"] == "mixed@0.25" and pressure["is_paired"]
    assert pressure["oracle_static"]["stall_s"]["mean"] == pytest.approx(-0.4)  # 1 - 1.8/2 against 1 - 1/2
    assert pressure["oracle_static"]["stall_s"]["n"] == 3
    assert "same bytes" not in cells["mixed@0.25"]["vs_base"]
    same_bytes = cells["mixed@0.5"]["vs_base"]["same bytes"]
    assert same_bytes["base_cell"] == "mixed@0.25"
    assert same_bytes["oracle_static"]["stall_s"]["mean"] == pytest.approx(-0.3)  # 1 - 1.6/2 against 0.5
    lines = cr.report_lines(summary, "fp32")
    assert any("NOT BINDING" in line for line in lines)
    assert any("vs fp32 mixed@0.25 (same bytes, paired by seed)" in line for line in lines)


def test_other_requests_are_compared_by_their_means() -> None:
    base = cr.load_condition_results([_sweep([0, 1, 2], {0.25: 1.0})])
    more = cr.load_condition_results([_sweep([0, 1, 2], {0.25: 1.5}, demand=3000, basis=4000, mixed_requests=16)])
    change = cr.summarize({"fp32": base, "2x": more}, "fp32")["2x"]["cells"]["mixed@0.25"]["vs_base"]
    assert set(change) == {"same bytes"} and not change["same bytes"]["is_paired"]  # 0.25 of 3000 is no pressure match
    assert change["same bytes"]["oracle_static"]["stall_s"]["mean"] == pytest.approx(-0.25)


def test_welch_interval_of_two_samples() -> None:
    iv = welch_interval([1.0, 2.0, 3.0], [0.0, 0.0, 1.0, 1.0])
    # variances of the means 1/3 and 1/12; dof (5/12)^2 / ((1/3)^2 / 2 + (1/12)^2 / 3) = 3, t = 3.182
    assert iv["mean"] == pytest.approx(1.5) and iv["hi"] - 1.5 == pytest.approx(1.5 - iv["lo"])
    assert iv["hi"] - 1.5 == pytest.approx(3.1824 * (5 / 12) ** 0.5, rel=1e-3)
    assert welch_interval([1.0, 1.0], [0.0, 0.0]) == {"mean": 1.0, "lo": 1.0, "hi": 1.0, "n": 2}
    assert welch_interval([1.0], [0.0, 1.0])["n"] == 1


def test_parts_pool_like_sweep_merge_and_the_command_writes_json_and_png(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = []
    for i, seeds in enumerate(([0, 1], [2, 3])):
        sweep = _sweep(seeds, {0.25: 1.0})
        sweep["config"] |= {"ram_fracs": [0.25], "kv_shares": list(SHARES)}
        paths.append(tmp_path / f"p{i}.json")
        paths[-1].write_text(json.dumps(sweep))
    half = tmp_path / "half.json"
    half.write_text(json.dumps(_sweep([0, 1], {0.25: 1.5}, demand=2000)))
    out, png = tmp_path / "out.json", tmp_path / "gains.png"
    cr.main(["--condition", f"fp32={paths[0]},{paths[1]}", "--condition", f"bf16={half}", "--json", str(out),
             "--png", str(png)])  # fmt: skip
    written = json.loads(out.read_text())["summary"]
    assert written["fp32"]["cells"]["mixed@0.25"]["n"] == 4
    assert written["bf16"]["cells"]["mixed@0.25"]["vs_base"]["same pressure"]["oracle_static"]["stall_s"]["n"] == 2
    assert png.stat().st_size > 10_000
    assert "fp32 (strict SLO targets" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--condition", "fp32"], "expected NAME=SWEEP_JSON"),
        (["--condition", "a=x.json", "--base", "b"], "must name one of the conditions"),
        (["--condition", "a=/nonexistent/sweep.json"], "No such file"),
    ],
)
def test_bad_input_is_refused_with_a_message(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cr.main(argv)
    assert needle in str(exc.value) + capsys.readouterr().err

"""Pooling sweeps of one grid on disjoint seeds: the verdicts' intervals then count every seed; a different grid
or a seed in two sweeps is refused with the field or seed named, and nothing is written."""

from __future__ import annotations

import json
import pathlib

import pytest

from fallbackgate.sweep.merge import MergeError, main, merge

CONFIG = {"model_dir": "m", "workloads": ["short-chat"], "num_requests": 5, "mixed_requests": 8,
          "max_new_tokens": 256, "max_model_len": 512, "time_scale": 0.25, "ram_fracs": [0.5],
          "kv_shares": [0.3], "controllers": ["static_split", "independent_lru", "joint"], "slo_scale": 1.5,
          "step_time": "modeled", "held_out_seed": 2, "is_equivalent_allowed": True, "audit_rate": 1.0}  # fmt: skip


def _point(seed: int, controller: str, tpot_p99_ms: float, run_id: int) -> dict:
    metrics = {"slo_attainment": 0.5, "tpot_p99_ms": tpot_p99_ms, "read_bytes": 100.0, "stall_s": 1.0,
               "mean_kl": 0.0, "gate_passed": 1.0, "foo_lb_bytes": 50.0, "belady_expert_bytes": 60.0,
               "belady_kv_bytes": 0.0, "bytes_expert_exact_load": 100.0,
               "peak_pool_by_kind": {"expert": 10}}  # fmt: skip
    share = 0.3 if controller == "static_split" else None
    return {"workload": "short-chat", "ram_frac": 0.5, "ram_bytes": 20, "seed": seed, "controller": controller,
            "kv_share": share, "run_id": run_id, "metrics": metrics}  # fmt: skip


def _sweep(seeds: list[int], joint_ms: float, **config: object) -> dict:
    points = []
    for seed in seeds:
        for controller, ms in (("static_split", 10.0), ("independent_lru", 10.0), ("joint", joint_ms + seed % 2)):
            points.append(_point(seed, controller, ms, run_id=len(points) + 100 * seeds[0]))
    return {"config": CONFIG | {"seeds": seeds} | config, "points": points, "elapsed_s": 10.0,
            "slo_references": {"short-chat": {"slo_tpot_ms": [8.0, 16.0]}}}  # fmt: skip


def test_two_sweeps_pool_their_seeds_into_one_interval() -> None:
    merged = merge([_sweep([0, 1, 2], 8.0), _sweep([3, 4, 5, 6], 8.0)], ["a", "b"])
    assert merged["config"]["seeds"] == [0, 1, 2, 3, 4, 5, 6] and len(merged["points"]) == 21
    gains = merged["summary"]["comparisons"]["short-chat@0.5"]["gains"]["independent_lru"]["tpot_p99_ms"]
    assert gains["all"]["n"] == 7
    assert gains["all"]["mean"] == pytest.approx((4 * 0.2 + 3 * 0.1) / 7)  # 8 or 9 ms against 10
    assert gains["held_out"] == pytest.approx(0.2)  # seed 2
    assert merged["slo_references_by_source"]["b"] == {"short-chat": {"slo_tpot_ms": [8.0, 16.0]}}
    assert merged["elapsed_s"] == 20.0
    explicit = _sweep([3], 8.0, expert_admission="exact", class_budgets=None)  # as written since stop 49
    assert merge([_sweep([0, 1], 8.0), explicit], ["a", "b"])["config"]["seeds"] == [0, 1, 3]


@pytest.mark.parametrize(
    ("second", "needle"),
    [
        (_sweep([1, 3], 8.0), "seed 1 is in both a and b"),
        (_sweep([3], 8.0, max_new_tokens=16), "config 'max_new_tokens' is 16, not 256"),
        (_sweep([3], 8.0, held_out_seed=3), "'held_out_seed'"),
        ({**_sweep([3], 8.0), "points": [_point(3, "joint", 8.0, run_id=1)]}, "run 1 is in both a and b"),
        (_sweep([3], 8.0, expert_admission="lowbit_colder"), "'expert_admission' is 'lowbit_colder', not 'exact'"),
        (_sweep([3], 8.0, class_budgets={"strict": {}}), "'class_budgets'"),
    ],
)
def test_a_different_grid_or_a_repeated_seed_is_refused(second: dict, needle: str) -> None:
    with pytest.raises(MergeError, match=needle):
        merge([_sweep([0, 1], 8.0), second], ["a", "b"])


def test_the_command_writes_the_merged_sweep_and_its_heatmaps(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "m" / "sweep.json"
    a.write_text(json.dumps(_sweep([0, 1, 2], 8.0)))
    b.write_text(json.dumps(_sweep([3, 4], 8.0, max_new_tokens=16)))
    with pytest.raises(SystemExit) as exc:
        main([str(a), str(b), "--out", str(out)])
    assert exc.value.code == 2 and "max_new_tokens" in capsys.readouterr().err and not out.exists()
    b.write_text(json.dumps(_sweep([3, 4], 8.0)))
    assert main([str(a), str(b), "--out", str(out)]) == 0
    assert len(json.loads(out.read_text())["points"]) == 15
    assert (out.parent / "sweep-short-chat.png").stat().st_size > 5_000
    assert "| short-chat@0.5 |" in capsys.readouterr().out

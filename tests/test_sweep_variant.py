"""A joint variant against one sweep's partners: the verdicts are the variant's, its quality and its paired gain
over the base sweep's joint sit beside them, and sweeps of another grid, seeds or SLO targets are refused with
what differs named, nothing written."""

from __future__ import annotations

import json
import pathlib

import pytest

from fallbackgate.sweep.variant import VariantError, combine, main

CONFIG = {"model_dir": "m", "workloads": ["short-chat"], "num_requests": 5, "mixed_requests": 8,
          "max_new_tokens": 256, "max_model_len": 512, "time_scale": 0.25, "ram_fracs": [0.5],
          "kv_shares": [0.3], "controllers": ["static_split", "independent_lru", "joint"], "slo_scale": 1.5,
          "step_time": "modeled", "held_out_seed": 2, "is_equivalent_allowed": True, "audit_rate": 1.0,
          "expert_admission": "exact", "class_budgets": None}  # fmt: skip
TARGETS = {"short-chat": {"slo_tpot_ms": [8.0, 16.0], "slo_ttft_ms": [20.0, 40.0], "run_id": 1}}


def _point(seed: int, controller: str, tpot_p99_ms: float, run_id: int, **metrics: float) -> dict:
    base = {"slo_attainment": 0.5, "tpot_p99_ms": tpot_p99_ms, "read_bytes": 100.0, "stall_s": 1.0,
            "mean_kl": 1e-12, "max_p99_kl": 1e-11, "top1_agreement": 1.0, "gate_passed": 1.0,
            "foo_lb_bytes": 50.0, "belady_expert_bytes": 60.0, "belady_kv_bytes": 0.0,
            "bytes_expert_exact_load": 100.0, "peak_pool_by_kind": {"expert": 10}}  # fmt: skip
    share = 0.3 if controller == "static_split" else None
    return {"workload": "short-chat", "ram_frac": 0.5, "ram_bytes": 20, "seed": seed, "controller": controller,
            "kv_share": share, "run_id": run_id, "metrics": base | metrics}  # fmt: skip


def _base(seeds: list[int]) -> dict:
    points = []
    for seed in seeds:
        for controller, ms in (("static_split", 10.0), ("independent_lru", 10.0), ("joint", 9.0)):
            points.append(_point(seed, controller, ms, run_id=len(points)))
    return {"config": CONFIG | {"seeds": seeds}, "points": points, "slo_references": TARGETS}


def _variant(seeds: list[int], ms: float = 7.0, **config: object) -> dict:
    points = [
        _point(s, "joint", ms + s % 2, run_id=1000 + s, mean_kl=1e-6, max_p99_kl=1e-4, top1_agreement=0.99,
               count_expert_expert_lowbit=3.0)
        for s in seeds
    ]  # fmt: skip
    overrides = {"controllers": ["joint"], "expert_admission": "lowbit_colder", "class_budgets": {"b": {}}}
    return {"config": CONFIG | {"seeds": seeds} | overrides | config, "points": points, "slo_references": TARGETS}


def test_the_verdicts_are_the_variants_with_its_quality_and_gain_over_the_base_joint_beside() -> None:
    result = combine(_base([0, 1, 2, 3]), _variant([0, 1, 2, 3]), ("a", "b"))
    joints = [p for p in result["points"] if p["controller"] == "joint"]
    assert [p["run_id"] for p in joints] == [1000, 1001, 1002, 1003] and len(result["points"]) == 12
    tpot = result["summary"]["comparisons"]["short-chat@0.5"]["gains"]["independent_lru"]["tpot_p99_ms"]["all"]
    assert tpot["mean"] == pytest.approx(1 - 7.5 / 10)  # 7 or 8 ms against 10, not the base joint's 9
    assert result["config"]["expert_admission"] == "lowbit_colder" and result["config"]["joint_from"] == "b"
    quality = result["joint_quality"]["short-chat@0.5"]
    assert quality["base"]["mean_kl"] == pytest.approx(1e-12) and quality["variant"]["worst_p99_kl"] == 1e-4
    assert quality["variant"]["min_top1_agreement"] == 0.99 and quality["variant"]["lowbit_experts"] == 12
    assert quality["variant"]["gates_passed"] == 4 and quality["base"]["lowbit_experts"] == 0
    assert quality["variant_gain_over_base"]["tpot_p99_ms"]["mean"] == pytest.approx(1 - 7.5 / 9)


@pytest.mark.parametrize(
    ("variant", "needle"),
    [
        (_variant([0, 1, 2]), "config 'seeds' is \\[0, 1, 2\\], not \\[0, 1, 2, 3\\]"),
        (_variant([0, 1, 2, 3], max_new_tokens=16), "'max_new_tokens' is 16, not 256"),
        ({**_variant([0, 1, 2, 3]), "slo_references": {"short-chat": {"slo_tpot_ms": [9.0, 18.0]}}}, "SLO targets"),
        (_variant([0, 1, 2, 3], controllers=["joint", "static_split"]), "--controllers joint only"),
        ({**_variant([0, 1, 2, 3]), "points": _variant([0, 1, 2])["points"]}, "joint's run for"),
        ({**_variant([0, 1, 2, 3]), "points": [_point(s, "joint", 7.0, run_id=s) for s in range(4)]}, "run 0"),
    ],
)
def test_another_grid_seeds_or_targets_are_refused(variant: dict, needle: str) -> None:
    with pytest.raises(VariantError, match=needle):
        combine(_base([0, 1, 2, 3]), variant, ("a", "b"))


def test_merged_parts_must_share_their_targets() -> None:
    merged = {**_base([0, 1, 2, 3]), "slo_references_by_source": {"p": TARGETS, "q": TARGETS}}
    del merged["slo_references"]
    assert combine(merged, _variant([0, 1, 2, 3]), ("a", "b"))["slo_references"] == TARGETS
    other = {"short-chat": TARGETS["short-chat"] | {"slo_ttft_ms": [30.0, 60.0]}}
    with pytest.raises(VariantError, match="a: its parts ran against different SLO targets"):
        combine({**merged, "slo_references_by_source": {"p": TARGETS, "q": other}}, _variant([0, 1, 2, 3]), ("a", "b"))


def test_the_command_writes_the_combined_sweep_or_nothing(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "v" / "sweep.json"
    a.write_text(json.dumps(_base([0, 1, 2])))
    b.write_text(json.dumps(_variant([0, 1, 2], max_new_tokens=16)))
    with pytest.raises(SystemExit) as exc:
        main([str(a), str(b), "--out", str(out)])
    assert exc.value.code == 2 and "max_new_tokens" in capsys.readouterr().err and not out.exists()
    b.write_text(json.dumps(_variant([0, 1, 2])))
    assert main([str(a), str(b), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["sources"] == {"partners": str(a), "joint": str(b)}
    printed = capsys.readouterr().out
    assert "| short-chat@0.5 |" in printed and "low-bit 0 -> 9, gates 3/3" in printed

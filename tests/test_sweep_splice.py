"""Splicing a rerun of one controller into a sweep: its points replace that controller's, the other
controllers' stay, and the verdicts are recomputed; a rerun against other SLO targets, seeds or grid, or one
missing a cell, is refused naming what differs, and nothing is written. ``sweep --slo-from`` reads the
targets from one part and refuses a merged sweep or a different grid."""

from __future__ import annotations

import json
import pathlib

import pytest

from fallbackgate.commands.sweep import earlier_references
from fallbackgate.sweep.merge import MergeError
from fallbackgate.sweep.regime import RegimeConfig
from fallbackgate.sweep.splice import main, splice
from tests.test_sweep_merge import CONFIG, _point, _sweep

TARGETS = {"slo_tpot_ms": [8.0, 16.0], "slo_ttft_ms": [20.0, 40.0]}


def _base() -> dict:
    return {**_sweep([0, 1, 2, 3], 10.0), "slo_references": {"short-chat": TARGETS}, "command": "sweep all"}


def _rerun(joint_ms: float = 8.0, seeds: tuple[int, ...] = (0, 1, 2, 3), **references: object) -> dict:
    points = [_point(s, "joint", joint_ms, run_id=1000 + s) for s in seeds]
    return {"config": CONFIG | {"seeds": list(seeds), "controllers": ["joint"]}, "points": points,
            "slo_references": {"short-chat": {**TARGETS, "reused": True, **references}},
            "command": "sweep --controllers joint --slo-from base", "elapsed_s": 4.0}  # fmt: skip


def test_the_rerun_replaces_its_controller_and_the_verdicts_follow() -> None:
    base = _base()
    result = splice(base, _rerun(8.0), "base", "rerun")
    assert len(result["points"]) == len(base["points"]) == 12
    joint = [p for p in result["points"] if p["controller"] == "joint"]
    assert [p["run_id"] for p in joint] == [1000, 1001, 1002, 1003]
    assert [p["run_id"] for p in result["points"] if p["controller"] != "joint"] == [
        p["run_id"] for p in base["points"] if p["controller"] != "joint"
    ]
    gains = result["summary"]["comparisons"]["short-chat@0.5"]["gains"]["independent_lru"]["tpot_p99_ms"]
    assert gains["all"]["mean"] == pytest.approx(0.2) and gains["all"]["n"] == 4  # 8 ms against 10, every seed
    assert result["spliced"] == [{"source": "rerun", "controllers": ["joint"], "elapsed_s": 4.0,
                                  "command": "sweep --controllers joint --slo-from base"}]  # fmt: skip
    assert result["command"] == "sweep all" and result["slo_references"] == base["slo_references"]


@pytest.mark.parametrize(
    ("rerun", "needle"),
    [
        ({**_rerun(), "slo_references": {"short-chat": TARGETS}}, "SLO targets are not the base's"),
        (_rerun(slo_ttft_ms=[21.0, 42.0]), "SLO targets are not the base's"),
        (_rerun(seeds=(0, 1, 2)), "config 'seeds'"),
        ({**_rerun(), "config": CONFIG | {"seeds": [0, 1, 2, 3], "controllers": ["joint"], "time_scale": 1.0}},
         "config 'time_scale' is 1.0"),
        ({**_rerun(), "points": _rerun()["points"][:3] + [_point(3, "joint", 8.0, run_id=1)]}, "run 1 is in both"),
        ({**_rerun(), "points": _rerun()["points"][:3]}, "cells missing"),
    ],
)  # fmt: skip
def test_a_rerun_that_is_not_the_same_measurement_is_refused(rerun: dict, needle: str) -> None:
    with pytest.raises(MergeError, match=needle):
        splice(_base(), rerun, "base", "rerun")


def test_the_command_writes_the_spliced_sweep_or_nothing(tmp_path: pathlib.Path, capsys) -> None:
    base, rerun, out = tmp_path / "base.json", tmp_path / "rerun.json", tmp_path / "s" / "sweep.json"
    base.write_text(json.dumps(_base()))
    rerun.write_text(json.dumps(_rerun(seeds=(0, 1))))
    with pytest.raises(SystemExit) as exc:
        main([str(base), str(rerun), "--out", str(out)])
    assert exc.value.code == 2 and "'seeds'" in capsys.readouterr().err and not out.exists()
    rerun.write_text(json.dumps(_rerun()))
    assert main([str(base), str(rerun), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["spliced"][0]["source"] == str(rerun)
    assert "| short-chat@0.5 |" in capsys.readouterr().out


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

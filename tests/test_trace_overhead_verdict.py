"""The trace-cost benchmark's verdict: the pairs' geometric-mean overhead with a Student-t interval on log
ratios, judged against the 3 % goal."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from scipy import stats

from fallbackgate.bench.trace_overhead import main, overhead_verdict, pool


def test_equal_ratios_have_a_point_interval() -> None:
    out = overhead_verdict([0.98] * 5)
    cost = out["overhead_geomean"]
    assert cost["mean"] == pytest.approx(0.02)
    assert cost["lo"] == pytest.approx(0.02) and cost["hi"] == pytest.approx(0.02)
    assert out["goal_verdict"] == "met"


def test_interval_is_student_t_on_log_ratios() -> None:
    ratios = [0.95, 1.01, 0.99, 0.97]
    logs = [math.log(r) for r in ratios]
    mean = sum(logs) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 3)
    half = stats.t.ppf(0.975, 3) * sd / 2
    cost = overhead_verdict(ratios)["overhead_geomean"]
    assert cost["mean"] == pytest.approx(1 - math.exp(mean))
    assert cost["lo"] == pytest.approx(1 - math.exp(mean + half))
    assert cost["hi"] == pytest.approx(1 - math.exp(mean - half))
    assert cost["n"] == 4


def test_verdicts_follow_the_interval_ends() -> None:
    assert overhead_verdict([0.90, 0.91, 0.89, 0.90])["goal_verdict"] == "not met"
    assert overhead_verdict([0.80, 1.20, 0.95, 1.05])["goal_verdict"] == "undecided"
    assert overhead_verdict([1.00, 1.01, 0.99, 1.00])["goal_verdict"] == "met"
    assert overhead_verdict([0.96, 0.98], goal=0.05)["goal_verdict"] == "undecided"  # two pairs: t(1) is wide


def test_fewer_than_two_pairs_decide_nothing() -> None:
    assert overhead_verdict([0.5])["goal_verdict"] == "undecided"
    assert overhead_verdict([1.0])["goal_verdict"] == "undecided"
    nothing = overhead_verdict([0.0, -1.0])
    assert nothing["goal_verdict"] == "undecided" and nothing["overhead_geomean"]["n"] == 0


def test_a_verdict_on_the_point_estimate_alone_would_differ() -> None:
    """A mean cost of 2.4 % whose interval reaches past 3 %: undecided, not met."""
    out = overhead_verdict([0.99, 0.96, 0.98, 0.97])
    assert out["overhead_geomean"]["mean"] < 0.03 < out["overhead_geomean"]["hi"]
    assert out["goal_verdict"] == "undecided"


def _part(path: Path, ratios: list[float], tokens: int = 128) -> str:
    path.write_text(json.dumps({
        "max_new_tokens": tokens, "batch": 8, "device_budget_mb": None, "pair_ratios": ratios,
        "pair_ratios_after_collection": [r - 0.01 for r in ratios], "trace_cpu_share": [0.015] * len(ratios),
    }))  # fmt: skip
    return str(path)


def test_pooled_parts_are_judged_on_every_pair(tmp_path: Path) -> None:
    first, second = [0.99, 0.95, 1.00], [0.97, 0.99, 0.98, 1.01]
    out = pool([_part(tmp_path / "a.json", first), _part(tmp_path / "b.json", second)])
    assert out["reps"] == 7
    assert out["overhead_geomean"] == overhead_verdict(first + second)["overhead_geomean"]
    assert out["after_collection"] == overhead_verdict([r - 0.01 for r in first + second])
    assert out["parts"][str(tmp_path / "a.json")] == overhead_verdict(first)
    assert out["trace_cpu_share_interval"]["mean"] == pytest.approx(0.015)


def test_parts_of_different_experiments_are_not_pooled(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_new_tokens"):
        pool([_part(tmp_path / "a.json", [0.99, 1.0]), _part(tmp_path / "b.json", [0.99, 1.0], tokens=32)])
    same = _part(tmp_path / "c.json", [0.99, 1.0])
    with pytest.raises(ValueError, match="twice"):
        pool([same, str(tmp_path / "." / "c.json")])
    with pytest.raises(SystemExit) as exc:
        main(["--json", str(tmp_path / "out.json"), "--pool", str(tmp_path / "missing.json")])
    assert exc.value.code == 2 and not (tmp_path / "out.json").exists()

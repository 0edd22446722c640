"""The trace-cost benchmark's verdict: the pairs' geometric-mean overhead with a Student-t interval on log
ratios, judged against the 3 % goal."""

from __future__ import annotations

import math

import pytest
from scipy import stats

from fallbackgate.bench.trace_overhead import overhead_verdict


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

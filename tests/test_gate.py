"""Gate verdicts: budget checks, the exact/equivalent correctness check, and the gate command."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from fallbackgate.audit.gate import evaluate_run, judge_request
from fallbackgate.audit.stats import PositionDiff, request_stats, top1_outside_ties
from fallbackgate.audit.tolerances import EQUIVALENT_TOLERANCE, Floor, tolerance
from fallbackgate.commands import gate as gate_cmd
from fallbackgate.engine.tags import Tag
from fallbackgate.ledger.db import open_ledger
from fallbackgate.ledger.synthetic import synthetic_output, synthetic_step
from fallbackgate.ledger.writer import LedgerWriter

EXACT = [Tag.RESIDENT, Tag.EXACT_LOAD]


def _stats(max_kl: float, mean_kl: float | None = None, top1: float = 1.0) -> dict[str, float]:
    mean = max_kl if mean_kl is None else mean_kl
    return {"mean_kl": mean, "p99_kl": max_kl, "max_kl": max_kl, "top1_agreement": top1}


def test_tolerances() -> None:
    assert tolerance("exact", None) == 1e-9  # absolute minimum
    assert tolerance("exact", 3e-7) == pytest.approx(3e-6)  # 10 × the control's floor
    assert tolerance("equivalent", None) == EQUIVALENT_TOLERANCE == 1e-9
    assert tolerance("equivalent", 1e-11) == pytest.approx(1e-8)  # 1000 × the floor
    assert tolerance("approximate", 0.0) == float("inf")


def test_tolerances_follow_the_floor_in_bfloat16() -> None:
    """bf16 exact computation differs by ~1e-4 nats: a fixed 1e-9 would fail every exact request."""
    floor = Floor(max_kl=3e-4, mean_kl=2e-5, p99_kl=2e-4, max_abs_dlogit=0.06, dtype="bfloat16")
    assert tolerance("exact", floor) == pytest.approx(3e-3)
    assert tolerance("equivalent", floor) == pytest.approx(3e-3)  # measured at the exact paths' scale
    assert tolerance("exact", Floor(dtype="bfloat16")) == pytest.approx(1e-5)  # a zero floor: the dtype's resolution
    exact = judge_request("r", _stats(1e-3, 1e-4, top1=1.0), None, {"exact": 40}, {"resident": 40}, floor)
    assert exact.passed
    bug = judge_request("r", _stats(5e-3, 1e-4), None, {"exact": 40}, {"resident": 40}, floor)
    assert bug.correctness_bug and "5e-03" in bug.reason.replace("0.005", "5e-03")


def test_budgets_are_counted_above_the_floor_and_near_ties_do_not_count() -> None:
    floor = Floor(max_kl=3e-4, mean_kl=2e-5, p99_kl=2e-4, max_abs_dlogit=0.06, dtype="bfloat16")
    budget = {"max_mean_kl": 1e-6, "max_p99_kl": 1e-6, "min_top1_agreement": 1.0}
    within = {**_stats(1e-3, 1.5e-4), "p99_kl": 1.9e-3, "top1_agreement": 0.95, "top1_outside_ties": 1.0}
    assert judge_request("r", within, budget, {"exact": 40}, {"resident": 40}, floor).passed
    beyond = {**within, "mean_kl": 3e-4, "top1_outside_ties": 0.95}
    v = judge_request("r", beyond, budget, {"exact": 40}, {"resident": 40}, floor)
    assert not v.passed and not v.correctness_bug
    assert "mean KL 0.0003 > budget 1e-06 + floor allowance 0.0002" in v.reason
    assert "top-1 agreement 0.95 (near-ties not counted) < budget 1" in v.reason
    flips = [PositionDiff(0, 0, 0.0, False, 0.0, 0.0, True, -1.0, -1.0, exact_top2_gap=0.1)]
    flips.append(PositionDiff(1, 0, 0.0, False, 0.0, 0.0, True, -1.0, -1.0, exact_top2_gap=0.5))
    assert top1_outside_ties(flips, tie_margin=0.12) == 0.5  # the 0.1 gap is a near-tie, the 0.5 one is not


def test_exact_only_difference_is_a_correctness_bug() -> None:
    v = judge_request("r", _stats(2e-6), None, {"exact": 40}, {"resident": 40}, None)
    assert not v.passed and v.correctness_bug and "correctness bug" in v.reason
    ok = judge_request("r", _stats(2e-6), None, {"exact": 40}, {"resident": 40}, 5e-7)  # floor 5e-7 -> tol 5e-6
    assert ok.passed and ok.served == "exact"
    eq = judge_request(
        "r",
        _stats(5e-10),
        None,
        {"exact": 30, "equivalent": 2},
        {"cpu_execute": 2},
        None,
    )
    assert eq.passed and eq.served == "equivalent"
    bad = judge_request("r", _stats(2e-8), None, {"equivalent": 2}, {"recompute": 2}, None)
    assert not bad.passed and bad.correctness_bug


def test_budget_checks_name_each_breach() -> None:
    budget = {
        "max_mean_kl": 0.01,
        "max_p99_kl": 0.05,
        "min_top1_agreement": 0.9,
        "max_approx_fraction": 0.1,
    }
    by_exactness = {"exact": 8, "approximate": 2}
    v = judge_request(
        "r",
        _stats(0.2, mean_kl=0.02, top1=0.8),
        budget,
        by_exactness,
        {"expert_defer": 2},
        None,
    )
    assert not v.passed and not v.correctness_bug
    assert v.reasons == [
        "mean KL 0.02 > budget 0.01",
        "p99 KL 0.2 > budget 0.05",
        "top-1 agreement 0.8 < budget 0.9",
        "approximate fraction 0.2 > 0.1",
    ]
    ok = judge_request(
        "r",
        _stats(0.04, 0.005, 0.95),
        budget,
        {"exact": 95, "approximate": 5},
        {},
        None,
    )
    assert ok.passed and ok.served == "approximate"  # approximate requests have no exactness tolerance


def test_allowed_tags_only_restrict_approximate_tags() -> None:
    tags = {"resident": 5, "cpu_execute": 1, "kv_dequant": 2, "expert_defer": 1}
    v = judge_request("r", None, {"allowed_tags": ["expert_defer"]}, {"approximate": 3}, tags, None)
    assert not v.passed and v.reasons == ["tags not allowed: kv_dequant"]
    assert judge_request("r", None, {"allowed_tags": ["expert_defer", "kv_dequant"]}, {}, tags, None).passed


def _diffs(kls: list[float], disagree_at: int | None = None) -> list[PositionDiff]:
    return [PositionDiff(i, 0, kl, i != disagree_at, 0.0, 0.0, True, -1.0, -1.0) for i, kl in enumerate(kls)]


def _write_run(path: Path, finish: bool = True) -> int:
    """Four requests, each on its own 4 steps: exact ok, exact with a bug at position 2,
    approximate over budget (expert_defer on layer 1), equivalent within tolerance."""
    plan = {
        "exact_ok": (EXACT, [0.0] * 4, None, None),
        "exact_bug": (EXACT, [0.0, 0.0, 3e-3, 1e-3], None, None),
        "approx": (
            [Tag.RESIDENT, Tag.EXPERT_DEFER],
            [0.0, 0.2, 0.3, 0.1],
            1,
            {"max_mean_kl": 0.05},
        ),
        "equiv": ([Tag.RESIDENT, Tag.CPU_EXECUTE], [5e-10] * 4, None, None),
    }
    with open_ledger(str(path)) as ledger, LedgerWriter(ledger) as w:
        run_id = w.start_run(mode="enforce")
        for k, (rid, (tags, kls, disagree, budget)) in enumerate(plan.items()):
            for i in range(4):
                w.record_step(*synthetic_step(10 * k + i, [rid], num_layers=3, events_per_layer=2, tags=tags))
            w.record_request(synthetic_output(rid, num_output=4), budget=budget)
            diffs = _diffs(kls, disagree)
            w.record_diffs(rid, diffs, request_stats(diffs))
        w.record_control(1e-8)
        if finish:
            w.finish_run()
    return run_id


def test_evaluate_run_locates_first_divergence(tmp_path: Path) -> None:
    path = tmp_path / "l.sqlite"
    run_id = _write_run(path)
    with open_ledger(str(path), read_only=True) as ledger:
        verdict = evaluate_run(ledger, run_id)
    by_id = {v.request_id: v for v in verdict.requests}
    assert not verdict.passed and verdict.reasons == ["2 of 4 requests failed: exact_bug, approx"]
    assert by_id["exact_ok"].passed and by_id["equiv"].passed and by_id["equiv"].served == "equivalent"
    bug = by_id["exact_bug"]
    assert bug.correctness_bug and (bug.position, bug.step, bug.layer) == (2, 12, 0)
    assert bug.tags == ["exact_load", "resident"]
    approx = by_id["approx"]
    assert not approx.correctness_bug and "mean KL" in approx.reason
    assert (approx.position, approx.step, approx.layer) == (
        1,
        21,
        0,
    )  # first top-1 disagreement
    assert approx.tags == ["expert_defer", "resident"]


def _args(ledger: str, run: int | None, record: bool = False) -> argparse.Namespace:
    return argparse.Namespace(ledger=ledger, run=run, record=record)


def test_gate_command_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "l.sqlite"
    run_id = _write_run(path)
    assert gate_cmd.run(_args(str(path), run_id, record=True)) == 1
    out = capsys.readouterr().out
    assert "correctness bug" in out and "pos 2, step 12, layer 0" in out and f"run {run_id}" in out
    with (
        open_ledger(str(path), read_only=True) as ledger,
        ledger.engine.connect() as conn,
    ):
        n = conn.exec_driver_sql("SELECT count(*), sum(passed) FROM verdicts").fetchone()
    assert tuple(n) == (5, 2)  # 4 requests (2 passed) + the run
    assert gate_cmd.run(_args(str(path), 999)) == 2
    assert "no run 999" in capsys.readouterr().err
    assert gate_cmd.run(_args("postgresql:/broken", None)) == 2
    assert "malformed ledger URL" in capsys.readouterr().err
    assert gate_cmd.run(_args(str(tmp_path / "absent.sqlite"), None)) == 2
    assert not (tmp_path / "absent.sqlite").exists()


def test_gate_passes_clean_run_and_fails_incomplete_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "l.sqlite"
    with open_ledger(str(path)) as ledger, LedgerWriter(ledger) as w:
        w.start_run()
        w.record_step(*synthetic_step(0, ["a"], tags=EXACT))
        w.record_request(synthetic_output("a", num_output=1))
        w.record_diffs("a", _diffs([0.0]), request_stats(_diffs([0.0])))
        w.finish_run()
    assert gate_cmd.run(_args(str(path), None)) == 0
    assert "PASS" in capsys.readouterr().out
    crashed = _write_run(tmp_path / "c.sqlite", finish=False)
    assert gate_cmd.run(_args(str(tmp_path / "c.sqlite"), crashed)) == 1
    assert "run is incomplete" in capsys.readouterr().out

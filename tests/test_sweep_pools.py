"""Two sweeps' gains compared cell by cell (`python -m fallbackgate.sweep.pools`)."""

from __future__ import annotations

import json
import math

import pytest
from scipy import stats

from fallbackgate.sweep import pools


def _summary(cells: dict[str, dict[str, list[float]]]) -> dict:
    """cell -> metric -> joint's per-seed gains over two LRUs (over the chosen split: the same, negated)."""
    comparisons = {}
    for cell, by_metric in cells.items():
        lru = {m: {"per_seed": {str(i): v for i, v in enumerate(vs)}} for m, vs in by_metric.items()}
        static = {m: {"per_seed": {str(i): -v for i, v in enumerate(vs)}} for m, vs in by_metric.items()}
        comparisons[cell] = {"gains": {"independent_lru": lru, "chosen_static": static}}
    return {"comparisons": comparisons}


FIRST = _summary({
    "mixed@0.25": {"tpot_p99_ms": [0.10, 0.12, 0.14, 0.16], "slo_attainment": [0.0, 0.1, 0.0, 0.1]},
    "short-chat@0.5": {"tpot_p99_ms": [0.01, 0.03, 0.02], "slo_attainment": [0.2, 0.0, 0.1]},
})  # fmt: skip
SECOND = _summary({
    "mixed@0.25": {"tpot_p99_ms": [0.00, 0.02, 0.04], "slo_attainment": [0.1, 0.0, 0.1, 0.0]},
    "short-chat@0.5": {"tpot_p99_ms": [0.01, 0.03, 0.02], "slo_attainment": [0.2, 0.0, 0.1]},
    "long-reasoning@0.5": {"tpot_p99_ms": [0.5, 0.6], "slo_attainment": [0.0, 0.0]},
})  # fmt: skip
THIRD = _summary({
    "mixed@0.25": {"tpot_p99_ms": [0.00, 0.02, 0.04], "slo_attainment": [0.1, 0.0, 0.1, 0.0]},
    "short-chat@0.5": {"tpot_p99_ms": [0.01], "slo_attainment": [0.2]},  # one seed: no interval
})  # fmt: skip


def test_differences_are_points_with_a_welch_interval_over_the_common_cells() -> None:
    cells = pools.cell_differences(FIRST, SECOND, ("independent_lru",))
    assert sorted(cells) == ["mixed@0.25", "short-chat@0.5"]  # long reasoning is in one sweep only
    d = cells["mixed@0.25"]["independent_lru"]["tpot_p99_ms"]
    a, b = [10.0, 12.0, 14.0, 16.0], [0.0, 2.0, 4.0]
    va, vb = stats.tvar(a) / 4, stats.tvar(b) / 3
    dof = (va + vb) ** 2 / (va**2 / 3 + vb**2 / 2)
    half = stats.t.ppf(0.975, dof) * math.sqrt(va + vb)
    assert d["mean"] == pytest.approx(11.0)
    assert (d["lo"], d["hi"]) == pytest.approx((11.0 - half, 11.0 + half))
    assert (d["n_first"], d["n_second"]) == (4, 3)
    same = cells["short-chat@0.5"]["independent_lru"]["tpot_p99_ms"]
    assert same["mean"] == pytest.approx(0.0) and same["lo"] < 0 < same["hi"]


def test_overall_counts_the_cells_wholly_above_or_below_zero() -> None:
    summary = pools.overall(pools.cell_differences(FIRST, SECOND, ("independent_lru", "chosen_static")))
    tpot = summary["independent_lru"]["tpot_p99_ms"]
    assert tpot["above"] == ["mixed@0.25"] and tpot["below"] == []
    assert tpot["mean_of_cells"] == pytest.approx(5.5) and tpot["num_cells"] == 2  # (11 + 0) / 2
    static_tpot = summary["chosen_static"]["tpot_p99_ms"]  # the partners are kept apart: negated gains
    assert static_tpot["below"] == ["mixed@0.25"] and static_tpot["above"] == []
    assert static_tpot["mean_of_cells"] == pytest.approx(-5.5)
    slo = summary["chosen_static"]["slo_attainment"]
    assert slo["above"] == [] and slo["below"] == [] and slo["mean_of_cells"] == pytest.approx(0.0)


def test_a_cell_without_an_interval_is_left_out_of_the_mean_and_counted() -> None:
    summary = pools.overall(pools.cell_differences(FIRST, THIRD, ("independent_lru",)))
    tpot = summary["independent_lru"]["tpot_p99_ms"]
    assert tpot["num_cells"] == 1 and tpot["num_without_interval"] == 1
    assert tpot["mean_of_cells"] == pytest.approx(11.0)  # not nan
    text = "\n".join(pools.lines(pools.cell_differences(FIRST, THIRD, ("independent_lru",)), summary))
    assert "mean over 1 cells +11.0 points" in text and "1 cell(s) without an interval" in text


def test_main_prints_and_writes_json(tmp_path, capsys) -> None:
    paths = []
    for name, summary in (("a", FIRST), ("b", SECOND)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"points": [], "summary": summary}))
        paths.append(str(path))
    out = tmp_path / "pools.json"
    assert pools.main([*paths, "--partners", "independent_lru", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "mixed@0.25" in text and "tpot_p99_ms +11.0" in text
    assert "vs independent_lru tpot_p99_ms: mean over 2 cells +5.5 points; above 0: mixed@0.25" in text
    written = json.loads(out.read_text())
    assert written["cells"]["mixed@0.25"]["independent_lru"]["tpot_p99_ms"]["mean"] == pytest.approx(11.0)


def test_bad_input_is_a_clear_error(tmp_path, capsys) -> None:
    no_summary = tmp_path / "raw.json"
    no_summary.write_text(json.dumps({"points": []}))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"summary": _summary({"mixed@0.5": {"tpot_p99_ms": [0.1, 0.2]}})}))
    first = tmp_path / "first.json"
    first.write_text(json.dumps({"summary": FIRST}))
    null_summary = tmp_path / "null.json"
    null_summary.write_text(json.dumps({"summary": None}))
    no_partner = tmp_path / "no-partner.json"
    no_partner.write_text(json.dumps({"summary": {"comparisons": {"mixed@0.25": {"gains": {}}}}}))
    for argv, text in (
        ([str(no_summary), str(first)], "no sweep summary"),
        ([str(first), str(null_summary)], "no sweep summary"),
        ([str(first), str(no_partner)], "no cell of both sweeps compares joint with independent_lru"),
        ([str(first), str(other)], "share no (workload, RAM) cell"),
        ([str(first), str(tmp_path / "missing.json")], "missing.json"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            pools.main(argv)
        assert exit_info.value.code == 2
        assert text in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        pools.main([str(first), str(first), "--partners", "lru"])
    assert exit_info.value.code == 2
    assert "unknown lru" in capsys.readouterr().err

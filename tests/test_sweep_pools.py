"""Two sweeps' gains compared cell by cell (`python -m fallbackgate.sweep.pools`)."""

from __future__ import annotations

import json
import math

import pytest
from scipy import stats

from fallbackgate.sweep import pools


def _summary(cells: dict[str, dict[str, list[float]]]) -> dict:
    """cell -> metric -> joint's per-seed gains over two LRUs (the same gains over the chosen split)."""
    comparisons = {}
    for cell, by_metric in cells.items():
        gains = {m: {"per_seed": {str(i): v for i, v in enumerate(vs)}} for m, vs in by_metric.items()}
        comparisons[cell] = {"gains": {"independent_lru": gains, "chosen_static": gains}}
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
    assert tpot["mean_of_cells"] == pytest.approx(5.5)  # (11 + 0) / 2
    slo = summary["chosen_static"]["slo_attainment"]
    assert slo["above"] == [] and slo["below"] == [] and slo["mean_of_cells"] == pytest.approx(0.0)


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
    for argv, text in (
        ([str(no_summary), str(first)], "no sweep summary"),
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

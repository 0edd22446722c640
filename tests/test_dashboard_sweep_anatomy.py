"""The Budget sweep page's TPOT anatomy: the shipped sweep's parts and ceilings as its JSON has them, one sweep
at a time where several are named, and a malformed anatomy as a warning, not a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fallbackgate.commands.dashboard import SHIPPED_SWEEP
from fallbackgate.dashboard import sweep_data
from tests.test_dashboard import chart_rows, charts, frame, open_page
from tests.test_dashboard_ledger import real_ledger


@pytest.fixture(scope="module")
def db() -> Path:
    return real_ledger()


def test_budget_sweep_shows_the_anatomy_of_the_shipped_sweep(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shipped = json.loads(SHIPPED_SWEEP.read_text())
    monkeypatch.setenv("FALLBACKGATE_SWEEP_JSON", str(SHIPPED_SWEEP))
    at = open_page(db, "sweep", monkeypatch)
    assert [s.value for s in at.subheader][-1] == "Where the slowest request's time goes"
    spec = charts(at)[1]
    assert spec["facet"]["field"] == "cell" and spec["spec"]["encoding"]["order"]["field"] == "part_rank"
    (parts,) = chart_rows(at, 1)
    joint = shipped["anatomy"]["mixed@0.25"]["mean"]["joint"]
    got = parts[(parts.cell == "mixed@0.25") & (parts.run == "joint")].set_index("part")["ms"]
    names = list(shipped["anatomy"]["mixed@0.25"]["parts"])
    assert names == ["stall_ms", "prefill_step_ms", "decode_step_ms", "gap_ms"]  # in the order the chart stacks
    assert got.to_dict() == pytest.approx({k.removesuffix("_ms"): joint[f"p99_request_{k}"] for k in names})
    assert list(parts.sort_values("part_rank")["part"].unique()) == [k.removesuffix("_ms") for k in names]
    assert list(parts.sort_values("run_rank")["run_label"].unique()) == ["joint", "chosen static", "two LRUs"]
    assert len(parts) == 10 * 3 * 4  # cells × runs × parts
    ceilings = frame(at, "stall_ceiling_%")
    row = ceilings[(ceilings.cell == "long-reasoning@0.5") & (ceilings.partner == "independent_lru")].iloc[0]
    vs = shipped["anatomy"]["long-reasoning@0.5"]["vs"]["independent_lru"]
    assert row["stall_ceiling_%"] == pytest.approx(100 * vs["stall_ceiling"]["mean"], abs=0.05)
    assert row["joint_tpot_p99_gain_lo_%"] == pytest.approx(100 * vs["joint_tpot_p99_gain"]["lo"], abs=0.05)


def test_several_sweeps_are_shown_one_at_a_time_and_a_malformed_anatomy_is_a_warning(
    db: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    shipped = json.loads(SHIPPED_SWEEP.read_text())
    (tmp_path / "a.json").write_text(json.dumps(shipped))
    (tmp_path / "b.json").write_text(json.dumps(shipped))
    (tmp_path / "c.json").write_text(json.dumps({"points": shipped["points"][:3], "anatomy": {"w@0.5": 5}}))
    monkeypatch.setenv("FALLBACKGATE_SWEEP_JSON", str(tmp_path))
    at = open_page(db, "sweep", monkeypatch)
    assert any("c.json: its anatomy is malformed" in w.value for w in at.warning)
    assert at.selectbox(key="anatomy_source").options == [str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    (parts,) = chart_rows(at, 1)
    assert len(parts) == 10 * 3 * 4 and set(parts["source"]) == {str(tmp_path / "a.json")}  # not a + b summed


def test_an_anatomy_written_before_cells_named_their_parts_and_runs_is_a_warning_with_the_fix(
    tmp_path: Path,
) -> None:
    shipped = json.loads(SHIPPED_SWEEP.read_text())
    named = ("parts", "runs")
    old = {key: {k: v for k, v in cell.items() if k not in named} for key, cell in shipped["anatomy"].items()}
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"points": shipped["points"][:3], "anatomy": old}))
    parts, _, problems = sweep_data.load_anatomy(str(path))
    assert parts.empty and len(problems) == 1
    assert "names no parts and runs" in problems[0] and f"python -m fallbackgate.sweep.anatomy {path}" in problems[0]


def test_a_sweep_json_is_parsed_once_per_version(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"points": [], "n": 1}))
    first = sweep_data.read_doc(path)
    assert sweep_data.read_doc(path) is first  # the same parse, not a second one
    path.write_text(json.dumps({"points": [], "n": 22}))  # another size: another version
    assert sweep_data.read_doc(path) == {"points": [], "n": 22}


def test_budget_sweep_shows_the_shipped_sweeps_verdicts(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shipped = json.loads(SHIPPED_SWEEP.read_text())["summary"]["verdicts"]
    monkeypatch.setenv("FALLBACKGATE_SWEEP_JSON", str(SHIPPED_SWEEP))
    at = open_page(db, "sweep", monkeypatch)
    assert "Verdicts against the goals" in [s.value for s in at.subheader]
    table = frame(at, "stricter_verdict")
    mixed = table[(table.goal == "mixed_vs_static") & (table.cell == "mixed@0.5")].iloc[0]
    expected = shipped["mixed_vs_static"]["mixed@0.5"]
    assert (mixed["verdict"], mixed["stricter_verdict"]) == (expected["verdict"], expected["verdict_per_metric_best"])
    assert mixed["gain_lo_%"] == pytest.approx(100 * expected["chosen"]["lo"], abs=0.05)
    lrus = table[table.goal == "vs_independent"]
    assert len(lrus) == 10 and (lrus.verdict == "met").sum() == sum(
        v["verdict"] == "met" for v in shipped["vs_independent"].values()
    )
    within = table[table.goal == "within_static"]
    assert len(within) == 2 * 8 and set(within.metric) == {"slo_attainment", "tpot_p99_ms"}

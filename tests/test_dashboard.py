"""AppTest tests of every dashboard page over a ledger produced by real engine runs: the numbers shown
must equal those computed here with plain SQL and numpy, independently of ledger.queries."""

from __future__ import annotations

import datetime as dt
import json
import math
import sqlite3
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from tests.test_dashboard_ledger import BUDGET, CALIBRATION, real_ledger, sql

APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")


@pytest.fixture(scope="module")
def db() -> Path:
    return real_ledger()


def open_page(db: Path, page: str, monkeypatch: pytest.MonkeyPatch, **params: str) -> AppTest:
    """Run the app on ``page`` over ledger ``db``; fail on any exception element."""
    monkeypatch.setenv("FALLBACKGATE_LEDGER", str(db))
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params["page"] = page
    for k, v in params.items():
        at.query_params[k] = v
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    return at


def metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def frame(at: AppTest, column: str) -> pd.DataFrame:
    """The first table shown that has ``column``."""
    return next(d.value for d in at.dataframe if column in d.value.columns)


def charts(at: AppTest) -> list[dict]:
    return [json.loads(c.proto.spec) for c in at.get("vega_lite_chart")]


def chart_rows(at: AppTest, index: int) -> list[pd.DataFrame]:
    from streamlit.dataframe_util import convert_arrow_bytes_to_pandas_df

    el = at.get("vega_lite_chart")[index].proto
    return [convert_arrow_bytes_to_pandas_df(d.data.data) for d in el.datasets]


OBJECTS = (  # events and the resident expert uses the step_requests rows count instead of events
    "(SELECT run_id, request_id, step_id, exactness, tag, count FROM events UNION ALL "
    "SELECT run_id, request_id, step_id, 'exact', 'resident', num_resident_expert_uses FROM step_requests "
    "WHERE num_resident_expert_uses > 0)"
)


def objects_by_exactness(db: Path, where: str = "1=1", params: tuple = ()) -> dict[tuple[int, str], int]:
    rows = sql(db, f"SELECT run_id, exactness, SUM(count) FROM {OBJECTS} WHERE {where} GROUP BY 1, 2", params)
    return {(r, c): n for r, c, n in rows}


def test_overview_numbers(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_page(db, "overview", monkeypatch)
    counts = objects_by_exactness(db)
    approx = sum(n for (_, c), n in counts.items() if c == "approximate")
    assert metrics(at) == {"Runs": "2", "Gate failures": "1", "Requests": "4", "Approximate objects": str(approx)}
    df = frame(at, "objects_exact").set_index("run_id")
    assert list(df.index) == [2, 1]  # newest first
    assert df.loc[1, "verdict"] == "pass" and df.loc[2, "verdict"] == "fail"
    assert df.loc[2, "link"] == "./?page=request&run=2"  # each run opens its drill-down
    for run_id in (1, 2):
        for exactness in ("exact", "equivalent", "approximate"):
            assert df.loc[run_id, f"objects_{exactness}"] == counts.get((run_id, exactness), 0)
        total = sum(counts.get((run_id, c), 0) for c in ("exact", "equivalent", "approximate"))
        assert df.loc[run_id, "share_approximate"] == pytest.approx(counts.get((run_id, "approximate"), 0) / total)
    # SLO: request a meets a loose SLO, b misses its 1 ms targets when measured, meets them modeled
    slo = sql(db, "SELECT run_id, request_id, ttft_s, tpot_s, modeled_ttft_s, modeled_tpot_s FROM requests")
    for run_id in (1, 2):
        rows = [r for r in slo if r[0] == run_id]
        measured = sum(1 for r in rows if r[1] == "a" or (r[2] <= 0.001 and r[3] <= 0.001)) / len(rows)
        modeled = sum(1 for r in rows if r[1] == "a" or (r[4] <= 0.001 and r[5] <= 0.001)) / len(rows)
        assert df.loc[run_id, "slo_attainment"] == pytest.approx(measured)
        assert df.loc[run_id, "slo_attainment_modeled"] == pytest.approx(modeled)
    assert df.loc[1, "slo_attainment"] == pytest.approx(0.5) and df.loc[1, "slo_attainment_modeled"] == 1.0
    specs = charts(at)
    assert len(specs) == 2 and "tag mix" not in json.dumps(specs[0]).lower()
    tags = chart_rows(at, 1)[0]
    expected = sql(db, f"SELECT run_id, tag, SUM(count) FROM {OBJECTS} GROUP BY 1, 2")
    got = {(int(r.run_id), r.tag): int(r.objects) for r in tags.itertuples()}
    assert got == {(r, t): n for r, t, n in expected}


def test_overview_filters_by_request_class(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_page(db, "overview", monkeypatch)
    at.multiselect(key="f_class").set_value(["chat"]).run()
    assert not at.exception
    counts = objects_by_exactness(db, "request_id = ?", ("a",))
    m = metrics(at)
    assert m["Requests"] == "2" and m["Runs"] == "2"
    assert m["Approximate objects"] == str(sum(n for (_, c), n in counts.items() if c == "approximate"))
    at.multiselect(key="f_class").set_value([]).run()
    (first,) = sql(db, "SELECT date(MIN(started_at)) FROM runs")[0]
    day = dt.date.fromisoformat(first)
    assert at.query_params["range"] in ("all", ["all"])  # the view is in the URL
    at.radio(key="f_range").set_value("24h").run()
    assert metrics(at)["Runs"] == "2" and at.query_params["range"] in ("24h", ["24h"])  # both started just now
    at.radio(key="f_range").set_value("dates").run()
    at.date_input(key="f_since").set_value(day).run()
    at.date_input(key="f_until").set_value(day + dt.timedelta(days=1)).run()
    assert metrics(at)["Runs"] == "2"  # both bounds inclusive of whole days
    at.date_input(key="f_since").set_value(day + dt.timedelta(days=1)).run()
    assert [i.value for i in at.info] == ["No runs match the filters."]
    at.date_input(key="f_since").set_value(None).run()
    at.multiselect(key="f_policy").set_value(["no-such-policy"]).run()
    assert [i.value for i in at.info] == ["No runs match the filters."]
    at.multiselect(key="f_policy").set_value(["exact_lru"]).run()
    assert metrics(at)["Runs"] == "2" and at.query_params["policy"] in ("exact_lru", ["exact_lru"])


def test_filters_come_from_the_url(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_page(db, "overview", monkeypatch, **{"class": "chat"})
    assert at.multiselect(key="f_class").value == ["chat"] and metrics(at)["Requests"] == "2"


def test_drift_numbers(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_page(db, "drift", monkeypatch)
    df = frame(at, "p99_kl").set_index("run_id")
    assert list(df.index) == [1, 2]  # oldest first
    for run_id in (1, 2):
        rows = sql(db, "SELECT kl, top1_agree, logp_exact, logp_engine FROM position_diffs WHERE run_id = ?", (run_id,))
        kl = np.array([r[0] for r in rows])
        assert df.loc[run_id, "positions"] == len(rows)
        assert df.loc[run_id, "mean_kl"] == pytest.approx(kl.mean(), rel=1e-9)
        assert df.loc[run_id, "p99_kl"] == pytest.approx(np.percentile(kl, 99), rel=1e-9)
        assert df.loc[run_id, "top1_agreement"] == pytest.approx(np.mean([r[1] for r in rows]))
        ratio = math.exp(np.mean([r[2] - r[3] for r in rows]))
        assert df.loc[run_id, "ppl_ratio"] == pytest.approx(ratio, rel=1e-9)
        floor = sql(db, "SELECT numeric_floor_kl FROM runs WHERE id = ?", (run_id,))[0][0]
        assert df.loc[run_id, "numeric_floor_kl"] == pytest.approx(floor)
    assert list(df["verdict"]) == ["pass", "fail"]
    last = df.loc[2]
    m = metrics(at)
    assert m["Mean KL (run 2)"] == f"{last['mean_kl']:.3e}" and m["p99 KL"] == f"{last['p99_kl']:.3e}"
    assert m["Gate failures"] == "1"
    kl_chart = chart_rows(at, 0)
    alerts = [d for d in kl_chart if "value" in d and "verdict" in d and len(d) == 1]
    assert alerts and list(alerts[0]["run_id"]) == [2]  # one alert marker, on the failed run
    assert list(alerts[0]["link"]) == ["./?page=request&run=2"]  # which opens its drill-down
    floors = [d for d in kl_chart if "floor" in d]
    assert floors and sorted(floors[0]["run_id"]) == [1, 2]


def test_request_drilldown_numbers(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_page(db, "request", monkeypatch, run="2", request="a")
    (mean_kl, p99, top1, ppl, first, ttft, mttft) = sql(
        db,
        "SELECT s.mean_kl, s.p99_kl, s.top1_agreement, s.ppl_ratio, s.first_divergence, r.ttft_s, r.modeled_ttft_s "
        "FROM request_stats s JOIN requests r USING (run_id, request_id) WHERE run_id = 2 AND request_id = 'a'",
    )[0]
    m = metrics(at)
    assert m["Mean KL"] == f"{mean_kl:.3e}" and m["p99 KL"] == f"{p99:.3e}" and m["PPL ratio"] == f"{ppl:.5f}"
    assert m["Top-1 agreement"] == f"{top1:.4f}" and m["Verdict"] == "fail"
    assert m["First divergence"] == ("none" if first is None else f"position {first}")
    assert m["TTFT measured"] == f"{1e3 * ttft:.4g} ms" and m["TTFT modeled"] == f"{1e3 * mttft:.4g} ms"
    reason, pos, step, layer, tags = sql(
        db,
        "SELECT reason, first_divergence_position, first_divergence_step, first_divergence_layer, "
        "first_divergence_tags FROM verdicts "
        "WHERE run_id = 2 AND request_id = 'a' ORDER BY id DESC LIMIT 1",  # the newest verdict is shown
    )[0]
    assert [w.value for w in at.warning] == [
        f"Gate failed: {reason} — first divergence at position {pos}, step {step}, layer {layer}, "
        f"tags {', '.join(json.loads(tags))}"
    ]
    budget = frame(at, "spent of limit").set_index("statistic")  # formatted for people: 3 digits, %, pass/FAIL
    assert budget.loc["mean KL", "budget"] == f"{BUDGET['max_mean_kl']:.3g}"
    assert budget.loc["mean KL", "measured"] == f"{mean_kl:.3g}"
    assert budget.loc["mean KL", "remaining"] == f"{BUDGET['max_mean_kl'] - mean_kl:.3g}"
    assert budget.loc["mean KL", "spent of limit"] == f"{100 * mean_kl / BUDGET['max_mean_kl']:.0f} %"
    assert budget.loc["mean KL", "verdict"] == "FAIL"
    served = dict(sql(db, f"SELECT exactness, SUM(count) FROM {OBJECTS} WHERE run_id=2 AND request_id='a' GROUP BY 1"))
    frac = served.get("approximate", 0) / sum(served.values())
    assert budget.loc["approximate fraction", "measured"] == f"{frac:.3g}"
    cells = set(
        sql(db, "SELECT DISTINCT step_id, layer, object_kind FROM events WHERE run_id = 2 AND request_id = 'a'")
    )
    for step_id, per_layer in sql(
        db,
        "SELECT step_id, resident_expert_uses FROM step_requests "
        "WHERE run_id = 2 AND request_id = 'a' AND resident_expert_uses IS NOT NULL",
    ):
        cells |= {(step_id, layer, "expert") for layer, n in enumerate(per_layer.split(",")) if int(n)}
    cells = len(cells)
    grid = chart_rows(at, 0)[0]
    assert len(grid) == cells and set(grid["tag"]) <= {"resident", "exact_load", "expert_defer", "kv_dequant"}
    kl = chart_rows(at, 1)[0]
    positions = sql(db, "SELECT position, kl FROM position_diffs WHERE run_id = 2 AND request_id = 'a' ORDER BY 1")
    assert list(kl["kl"]) == pytest.approx([r[1] for r in positions])
    steps = sql(
        db,
        "SELECT SUM(wall_s) FROM steps WHERE run_id = 2 AND step_id IN "
        "(SELECT step_id FROM step_requests WHERE run_id = 2 AND request_id = 'a')",
    )[0][0]
    timeline = chart_rows(at, 2)[0]
    assert timeline[timeline["time"] == "measured"]["value"].max() == pytest.approx(1e3 * steps)  # in ms


def test_request_drilldown_of_an_exact_request_has_no_divergence(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_page(db, "request", monkeypatch, run="1", request="b")
    m = metrics(at)
    assert m["First divergence"] == "none" and m["Verdict"] == "pass" and m["Top-1 agreement"] == "1.0000"
    assert "No quality budget was recorded for this request." in [i.value for i in at.info]
    assert "SLO targets: TTFT 1 ms, TPOT 1 ms" in [c.value for c in at.caption]  # request b's SLO, given in seconds
    at = open_page(db, "request", monkeypatch, run="1", request="a")
    assert "SLO targets: TTFT 1e+07 ms, TPOT 1e+07 ms" in [c.value for c in at.caption]  # given in ms


def test_request_drilldown_names_why_the_replay_could_not_follow(
    db: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    copy = tmp_path / "ledger.sqlite"
    with sqlite3.connect(db) as source, sqlite3.connect(copy) as target:
        source.backup(target)  # the ledger's pages may sit in its write-ahead log: a byte copy can miss them
    why = "request b: step 5 starts at position 8 but only 7 were computed before it (step rows missing?)"
    with sqlite3.connect(copy) as conn:
        conn.execute("UPDATE request_stats SET replay_error = ? WHERE run_id = 1 AND request_id = 'b'", (why,))
    monkeypatch.setenv("FALLBACKGATE_LEDGER", str(copy))
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params["page"], at.query_params["run"], at.query_params["request"] = "request", "1", "b"
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert [e.value for e in at.error] == [f"The replay could not follow this request's recorded actions: {why}"]


def test_calibration_numbers(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_page(db, "calibration", monkeypatch)
    expected = sql(
        db,
        "SELECT e.tag, e.layer, COUNT(*), AVG(e.p), AVG(d.kl) FROM (SELECT run_id, request_id, step_id, tag, layer, "
        "SUM(predicted_cost) AS p FROM events WHERE exactness = 'approximate' GROUP BY 1, 2, 3, 4, 5) e "
        "JOIN position_diffs d USING (run_id, request_id, step_id) GROUP BY 1, 2 ORDER BY 1, 2",
    )
    assert expected, "the forced run must pair approximate tags with measured KL"
    df = frame(at, "measured_over_predicted")
    paired = df.dropna(subset=["pairs"])
    assert [(r.tag, r.layer, r.pairs) for r in paired.itertuples()] == [(t, ly, n) for t, ly, n, _, _ in expected]
    assert list(paired["mean_measured_kl"]) == pytest.approx([r[4] for r in expected])
    assert list(paired["mean_predicted"]) == pytest.approx([r[3] for r in expected])
    tag, layer, scale = CALIBRATION
    assert df[(df.tag == tag) & (df.layer == layer)]["scale"].tolist() == [scale]
    m = metrics(at)
    assert m["Pairs"] == str(sum(r[2] for r in expected)) and m["Fitted scales"] == "1"


def test_budget_sweep_without_results_says_so(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FALLBACKGATE_SWEEP_JSON", raising=False)
    at = open_page(db, "sweep", monkeypatch)
    assert at.info[0].value.startswith("No sweep results yet.")


def test_budget_sweep_heatmaps_per_controller(db: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    points = [
        {"controller": c, "expert_budget_mb": e, "kv_budget_mb": k, "metrics": {"mean_kl": i * 0.01, "slo": 0.5}}
        for i, (c, e, k) in enumerate((c, e, k) for c in ("joint", "static_split") for e in (1, 2) for k in (4, 8))
    ]
    (tmp_path / "sweep.json").write_text(json.dumps({"points": points}))
    (tmp_path / "broken.json").write_text("{not json")
    monkeypatch.setenv("FALLBACKGATE_SWEEP_JSON", str(tmp_path))
    at = open_page(db, "sweep", monkeypatch)
    assert metrics(at) == {"Controllers": "2"}
    assert any("broken.json" in w.value for w in at.warning)
    df = frame(at, "source")
    assert len(df) == 8 and sorted(df["mean_kl"]) == pytest.approx([i * 0.01 for i in range(8)])
    spec = charts(at)[0]
    assert spec["facet"]["field"] == "controller" and spec["columns"] == 2  # panels wrap, never clipped
    at.selectbox(key="sweep_metric").set_value("slo").run()
    assert charts(at)[0]["spec"]["layer"][0]["encoding"]["color"]["field"] == "slo"


def test_pareto_page_plots_measured_tpot_against_audited_kl(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_page(db, "pareto", monkeypatch)
    rows = sql(
        db,
        "SELECT r.run_id, r.request_class, AVG(r.tpot_s), AVG(s.mean_kl) FROM requests r LEFT JOIN request_stats s "
        "ON s.run_id = r.run_id AND s.request_id = r.request_id GROUP BY 1, 2",
    )
    assert metrics(at)["Run × class points"] == str(len(rows))
    (points, *_) = chart_rows(at, 0)
    got = {(int(p.run_id), p.request_class): (p.tpot_ms, p.mean_kl) for p in points.itertuples()}
    for run_id, cls, tpot_s, mean_kl in rows:
        assert got[(run_id, cls)][0] == pytest.approx(1e3 * tpot_s)
        assert got[(run_id, cls)][1] == pytest.approx(mean_kl)
    spec = json.dumps(charts(at)[0])
    assert '"type": "log"' in spec and "measured TPOT (ms, log)" in spec


def test_compare_page_shows_two_runs_side_by_side(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_page(db, "compare", monkeypatch, a="1", b="2")
    table = frame(at, "B − A").set_index("")
    assert list(table.columns[:2]) == ["run 1", "run 2"]
    assert table.loc["verdict", "run 1"] == "pass" and table.loc["verdict", "run 2"] == "fail"
    (kl2,) = sql(db, "SELECT AVG(mean_kl) FROM request_stats WHERE run_id = 2")[0]
    assert float(table.loc["mean KL against exact (nats)", "run 2"]) == pytest.approx(kl2, rel=1e-2)
    assert len(charts(at)) == 1


def test_auto_refresh_is_a_url_toggle(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_page(db, "overview", monkeypatch, refresh="1")
    assert at.toggle(key="auto_refresh").value is True and metrics(at)["Runs"] == "2"
    at.toggle(key="auto_refresh").set_value(False).run()
    assert not at.exception and at.query_params["refresh"] in ("0", ["0"])

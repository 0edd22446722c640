"""AppTest of the Traces page over a ledger holding the analyses of two planted traces: the numbers shown are
the stored ones (read back here with plain SQL), and a ledger without analyses says how to make some."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from fallbackgate.ledger.db import open_ledger
from fallbackgate.tracing import read_trace
from fallbackgate.tracing.analyze import analyze_trace, store
from fallbackgate.tracing.synthetic import Planted, write_planted_trace

APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")


@pytest.fixture(scope="module")
def ledger(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    base = tmp_path_factory.mktemp("traces")
    path, traces = base / "ledger.sqlite", []
    with open_ledger(str(path)) as opened:
        for seed in (1, 2):
            write_planted_trace(base / f"t{seed}", Planted(seed=seed, num_steps_per_phase=150))
            store(opened, analyze_trace(read_trace(base / f"t{seed}"), base / "figures"))
            traces.append(str((base / f"t{seed}").resolve()))
    return path, traces


def open_traces(url: str, monkeypatch: pytest.MonkeyPatch, **params: str) -> AppTest:
    monkeypatch.setenv("FALLBACKGATE_LEDGER", url)
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params.update(page="traces", **params)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    return at


def stored(db: Path, trace: str, analysis: str, metric: str, device: str | None = None) -> tuple:
    query = "SELECT value, ci_low, ci_high, params FROM trace_analyses WHERE trace_path=? AND analysis=? AND metric=?"
    args: tuple = (trace, analysis, metric)
    if device is not None:
        query, args = query + " AND device=?", (*args, device)
    with sqlite3.connect(db) as con:
        return con.execute(query, args).fetchone()


@pytest.mark.parametrize("index", [0, 1])
def test_headline_numbers_are_the_stored_ones(ledger: tuple, index: int, monkeypatch: pytest.MonkeyPatch) -> None:
    db, traces = ledger
    at = open_traces(str(db), monkeypatch, trace=traces[index])
    assert at.selectbox(key="trace").value == traces[index]
    shown = {m.label: m.value for m in at.metric}
    lift = stored(db, traces[index], "co_burst", "lift")
    assert shown["Co-burst lift"] == f"{lift[0]:.3g}"
    assert f"95 % CI [{lift[1]:.3g}, {lift[2]:.3g}]" in [c.value for c in at.caption]
    assert shown["Peak lag (steps)"] == f"{stored(db, traces[index], 'co_burst', 'peak_lag')[0]:.3g}"
    assert (
        shown["Best-split flips (measured)"] == f"{stored(db, traces[index], 'flips', 'num_flips', 'measured')[0]:.3g}"
    )
    winner = json.loads(stored(db, traces[index], "marginal_value", "next_gib_to_experts", "measured")[3])["winner"]
    assert shown["Next GiB to"] == winner
    specs = [json.loads(c.proto.spec) for c in at.get("vega_lite_chart")]
    assert len(specs) == 2
    tables = {e.label.split(" (")[0]: e for e in at.expander}
    assert set(tables) == {"co_burst", "marginal_value", "flips", "dual_miss", "prediction", "devices"}


def test_no_analyses_says_how_to_make_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with open_ledger(str(tmp_path / "empty.sqlite")):
        pass
    at = open_traces(str(tmp_path / "empty.sqlite"), monkeypatch)
    assert "fallbackgate trace analyze" in at.info[0].value

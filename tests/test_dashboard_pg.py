"""The dashboard on PostgreSQL: the real-run ledger copied row for row into a PostgreSQL ledger shows
the same numbers on every page as the SQLite original (JSON SLO targets, window-function p99, row-value
class filters and the calibration join all run on both)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from sqlalchemy import insert, select, text
from sqlalchemy.exc import DBAPIError
from streamlit.testing.v1 import AppTest

from fallbackgate.ledger.db import begin_write, open_ledger
from fallbackgate.ledger.models import Base
from tests.pg_fixture import pg_server_fixture, pg_url_fixture  # noqa: F401 - fixtures
from tests.test_dashboard_ledger import real_ledger

APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")


def _copy(src: str, dst: str) -> None:
    with open_ledger(src, read_only=True) as a, open_ledger(dst) as b:
        with a.engine.connect() as ra, begin_write(b.engine) as wb:
            for table in Base.metadata.sorted_tables:
                rows = [dict(r) for r in ra.execute(select(table)).mappings()]
                if rows:
                    wb.execute(insert(table), rows)


def _shown(url: str, page: str, monkeypatch: pytest.MonkeyPatch, **params: str) -> tuple[dict, list[pd.DataFrame]]:
    monkeypatch.setenv("FALLBACKGATE_LEDGER", url)
    at = AppTest.from_file(APP, default_timeout=120)
    request_class = params.pop("class", None)
    at.query_params.update(page=page, **params)
    at.run()
    if request_class is not None:  # the class filter: a row-value IN (subquery) on both databases
        at.multiselect(key="f_class").set_value([request_class]).run()
    assert not at.exception and not at.error, [e.value for e in [*at.exception, *at.error]]
    frames = [d.value.drop(columns=["started_at", "fitted_at"], errors="ignore") for d in at.dataframe]
    return {m.label: m.value for m in at.metric}, frames


def test_postgresql_sessions_are_read_only(pg_url: str) -> None:
    from fallbackgate.dashboard import data

    _copy(str(real_ledger()), pg_url)
    ledger = data.connect(pg_url)
    with ledger.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM runs")).scalar() == 2
        with pytest.raises(DBAPIError, match="read-only transaction"):
            conn.execute(text("DELETE FROM runs"))
    with open_ledger(pg_url, read_only=True) as check, check.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM runs")).scalar() == 2


@pytest.mark.parametrize(
    ("page", "params"),
    [
        ("overview", {}),
        ("overview", {"class": "chat"}),
        ("drift", {"class": "batch"}),
        ("request", {"run": "2", "request": "b"}),
        ("calibration", {}),
        ("calibration", {"class": "chat"}),
    ],
)
def test_postgresql_ledger_shows_the_same_numbers(
    page: str, params: dict[str, str], pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = str(real_ledger())
    _copy(db, pg_url)
    lite_metrics, lite_frames = _shown(db, page, monkeypatch, **dict(params))
    pg_metrics, pg_frames = _shown(pg_url, page, monkeypatch, **dict(params))
    assert pg_metrics == lite_metrics
    assert len(pg_frames) == len(lite_frames)
    for pg, lite in zip(pg_frames, lite_frames, strict=True):
        pd.testing.assert_frame_equal(pg, lite, check_dtype=False, check_exact=False, rtol=1e-9)

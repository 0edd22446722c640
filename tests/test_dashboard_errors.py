"""Dashboard failure modes and safety: empty, older-schema, missing and unreachable ledgers show a
clear message (never a traceback); SQL-injection strings through every filter leave the data intact;
the ``fallbackgate dashboard`` command binds 127.0.0.1 and passes the URL through the environment."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
from alembic.script import ScriptDirectory
from streamlit.testing.v1 import AppTest

from fallbackgate import cli
from fallbackgate.commands import dashboard as command
from fallbackgate.ledger import db as ledger_db
from fallbackgate.ledger.db import open_ledger
from tests.test_dashboard_ledger import real_ledger, sql

APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")
PAGES = ("overview", "drift", "request", "calibration", "sweep")
INJECTIONS = (
    "x' OR '1'='1",
    "'; DROP TABLE runs; --",
    "1 OR 1=1",
    "a') UNION SELECT id, id, id FROM runs --",
    '" OR ""="',
)
TABLES = ("runs", "requests", "steps", "events", "position_diffs", "request_stats", "verdicts", "calibrations")


def run_app(url: str, monkeypatch: pytest.MonkeyPatch, page: str = "overview", **params: str) -> AppTest:
    monkeypatch.setenv("FALLBACKGATE_LEDGER", url)
    at = AppTest.from_file(APP, default_timeout=120)
    at.query_params.update(page=page, **params)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_empty_ledger_says_it_has_no_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "empty.sqlite"
    open_ledger(str(db)).close()
    for page in ("overview", "drift", "request", "calibration"):
        at = run_app(str(db), monkeypatch, page)
        assert [i.value for i in at.info] == [
            f"The ledger {'sqlite:///' + str(db)} has no runs yet. Record one: `fallbackgate run --ledger URL`."
        ]


def test_missing_file_and_unreachable_server_show_a_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    at = run_app(str(tmp_path / "nope.sqlite"), monkeypatch)
    assert [e.value for e in at.error] == [
        f"Cannot open the ledger: no ledger at {tmp_path / 'nope.sqlite'} (the file does not exist)"
    ]
    assert not (tmp_path / "nope.sqlite").exists()  # read-only: nothing created
    at = run_app("postgresql+psycopg://nobody@127.0.0.1:1/ledger", monkeypatch)
    (msg,) = [e.value for e in at.error]
    assert msg.startswith("Cannot open the ledger: cannot open ledger postgresql+psycopg://nobody@127.0.0.1:1/ledger")
    at = run_app("notascheme:/x", monkeypatch)
    assert [e.value for e in at.error][0].startswith("Cannot open the ledger: malformed ledger URL")


def test_older_schema_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "old.sqlite"
    open_ledger(str(db)).close()  # at today's newest revision
    head = ScriptDirectory.from_config(ledger_db.alembic_config()).get_current_head()
    newer = tmp_path / "migrations"
    shutil.copytree(ledger_db.MIGRATIONS_DIR, newer, ignore=shutil.ignore_patterns("__pycache__"))
    (newer / "versions" / "9000_later.py").write_text(
        f'revision = "9000"\ndown_revision = "{head}"\nbranch_labels = None\ndepends_on = None\n\n\n'
        "def upgrade() -> None:\n    pass\n\n\ndef downgrade() -> None:\n    pass\n"
    )
    monkeypatch.setattr(ledger_db, "MIGRATIONS_DIR", newer)  # this code now knows a newer schema
    at = run_app(str(db), monkeypatch)
    (msg,) = [e.value for e in at.error]
    assert f"has old schema revision '{head}' (newest: '9000')" in msg and msg.startswith("Cannot open the ledger:")


def _fingerprint(db: Path) -> tuple[str, list[int]]:
    return hashlib.sha256(db.read_bytes()).hexdigest(), [sql(db, f"SELECT COUNT(*) FROM {t}")[0][0] for t in TABLES]


@pytest.mark.parametrize("evil", INJECTIONS)
def test_injection_strings_through_every_filter_leave_data_intact(evil: str, monkeypatch: pytest.MonkeyPatch) -> None:
    db = real_ledger()
    before = _fingerprint(db)
    for key in ("f_policy", "f_model", "f_class"):
        at = run_app(str(db), monkeypatch, "overview")
        at.multiselect(key=key).set_value([evil]).run()
        assert not at.exception and not at.error
        assert [i.value for i in at.info] == ["No runs match the filters."]  # matched literally: nothing
        for page in ("drift", "calibration", "request"):
            at.sidebar.radio(key="page").set_value(page).run()
            assert not at.exception and not at.error, page
    at = run_app(str(db), monkeypatch, "request", run=evil)
    assert [w.value for w in at.warning] == [f"{evil!r} is not a run id (run ids are whole numbers)."]
    at = run_app(str(db), monkeypatch, "request", run="2", request=evil)
    assert [w.value for w in at.warning] == [f"Run 2 has no request {evil!r}."]
    at = run_app(str(db), monkeypatch, evil)  # unknown page: falls back to the overview
    assert at.metric[0].label == "Runs" and at.metric[0].value == "2"
    assert _fingerprint(db) == before


def test_command_binds_localhost_and_passes_the_url(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[list[str], dict[str, str]]] = []
    monkeypatch.setattr(command.subprocess, "call", lambda cmd, env: calls.append((cmd, env)) or 0)
    assert cli.main(["dashboard", "--ledger", "postgresql+psycopg://u@db:5432/l", "--port", "8600"]) == 0
    ((cmd, env),) = calls
    assert cmd[1:5] == ["-m", "streamlit", "run", str(command.APP)]
    assert cmd[cmd.index("--server.address") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--server.port") + 1] == "8600"
    assert env["FALLBACKGATE_LEDGER"] == "postgresql+psycopg://u@db:5432/l"
    assert command.APP.is_file()


def test_sqlite_ledger_is_opened_read_only() -> None:
    from sqlalchemy import text
    from sqlalchemy.exc import OperationalError

    from fallbackgate.dashboard import data

    ledger = data.connect(str(real_ledger()))
    assert ledger.read_only
    with ledger.engine.connect() as conn, pytest.raises(OperationalError, match="readonly"):
        conn.execute(text("DELETE FROM runs"))

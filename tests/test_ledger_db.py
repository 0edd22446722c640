"""Opening ledgers: migrations on SQLite and PostgreSQL, URL resolution and clear errors for bad inputs."""

from __future__ import annotations

import hashlib
import os
import sqlite3
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from fallbackgate.ledger.db import DEFAULT_LEDGER, ENV_VAR, LedgerError, head_revision, open_ledger
from fallbackgate.ledger.models import Base
from fallbackgate.ledger.writer import LedgerWriter
from tests.pg_fixture import free_port, pg_server_fixture, pg_url_fixture  # noqa: F401 - fixtures

TABLES = {
    "runs",
    "requests",
    "steps",
    "events",
    "position_diffs",
    "request_stats",
    "verdicts",
    "calibrations",
}


def _check_schema(url: str) -> None:
    with open_ledger(url) as ledger, ledger.engine.connect() as conn:
        assert TABLES <= set(inspect(conn).get_table_names())
        ctx = MigrationContext.configure(conn)
        assert ctx.get_current_revision() == head_revision()
        diffs = compare_metadata(ctx, Base.metadata)
        assert diffs == [], f"models and migrations disagree: {diffs}"
        idx = {i["name"] for i in inspect(conn).get_indexes("events")}
        assert {"ix_events_run_tag", "ix_events_run_request_step"} <= idx
    with open_ledger(url) as again:  # a second open is a no-op upgrade
        assert not again.read_only


def test_migrations_sqlite(tmp_path: Path) -> None:
    path = tmp_path / "l.sqlite"
    _check_schema(str(path))
    con = sqlite3.connect(path)
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_migrations_postgres(pg_url: str) -> None:
    _check_schema(pg_url)


def test_url_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(ENV_VAR, raising=False)
    with open_ledger(None) as ledger:
        assert ledger.url.database == str(tmp_path / Path(DEFAULT_LEDGER).name)
    monkeypatch.setenv(ENV_VAR, "sqlite:///env.sqlite")
    with open_ledger(None) as ledger:
        assert ledger.url.database == "env.sqlite"
    with open_ledger(str(tmp_path / "arg.sqlite")) as ledger:  # the argument wins over the variable
        assert ledger.is_sqlite and (tmp_path / "arg.sqlite").exists()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("postgresql:/nohost/db", "malformed ledger URL"),
        ("nosuchdb://host/db", "unknown database kind"),
        ("postgresql+psycopg://u@host:notaport/db", "malformed ledger URL"),
        ("missing-dir/x.sqlite", "does not exist"),
        ("", "empty"),
    ],
)
def test_bad_urls_write_nothing(url: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(LedgerError, match=message):
        open_ledger(url or " ")
    assert list(tmp_path.iterdir()) == []


def test_unreachable_server() -> None:
    url = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/nothing"
    with pytest.raises(LedgerError, match=r"cannot open ledger .*127\.0\.0\.1.*(refused|connect)"):
        open_ledger(url)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_newer_schema_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "l.sqlite"
    open_ledger(str(path)).close()
    con = sqlite3.connect(path)
    con.execute("UPDATE alembic_version SET version_num = '9999_from_the_future'")
    con.commit()
    con.close()
    before = _digest(path)
    for read_only in (False, True):
        with pytest.raises(LedgerError, match="newer than this fallbackgate knows"):
            open_ledger(str(path), read_only=read_only)
    assert _digest(path) == before


def test_newer_schema_postgres(pg_url: str) -> None:
    with open_ledger(pg_url) as ledger, ledger.engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = :v"), {"v": "9999_future"})
    with pytest.raises(LedgerError, match="newer"):
        open_ledger(pg_url)


def test_read_only_file_and_directory(tmp_path: Path) -> None:
    path = tmp_path / "l.sqlite"
    with open_ledger(str(path)) as ledger:
        LedgerWriter(ledger).close()
    path.chmod(0o444)
    before = _digest(path)
    with pytest.raises(LedgerError, match="read-only"):
        open_ledger(str(path))
    with (
        open_ledger(str(path), read_only=True) as ro,
        pytest.raises(LedgerError, match="read-only"),
    ):
        LedgerWriter(ro)
    assert _digest(path) == before
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        with pytest.raises(LedgerError, match="read-only"):
            open_ledger(str(locked / "new.sqlite"))
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o755)


def test_not_a_ledger(tmp_path: Path) -> None:
    junk = tmp_path / "notes.txt"
    junk.write_text("hello")
    with pytest.raises(LedgerError, match="not a SQLite database"):
        open_ledger(str(junk))
    other = tmp_path / "other.sqlite"
    sqlite3.connect(other).execute("CREATE TABLE runs (x int)").connection.commit()
    with pytest.raises(LedgerError, match="not a fallbackgate ledger"):
        open_ledger(str(other))
    with pytest.raises(LedgerError, match="no ledger at"):
        open_ledger(str(tmp_path / "absent.sqlite"), read_only=True)
    assert not (tmp_path / "absent.sqlite").exists()
    assert os.path.getsize(junk) == 5


def test_upgrade_from_0001_keeps_runs_and_labels_them_by_controller(tmp_path: Path) -> None:
    from alembic import command
    from sqlalchemy import create_engine

    from fallbackgate.ledger.dashboard_queries import RunFilter, overview_runs
    from fallbackgate.ledger.db import alembic_config

    path = tmp_path / "old.sqlite"
    cfg = alembic_config()
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0001")
        insert = "INSERT INTO runs (started_at, status, controller) VALUES ('2026-11-01', 'complete', 'joint')"
        conn.execute(text(insert))
    engine.dispose()
    with open_ledger(str(path)) as ledger:  # a writer's open upgrades the file to the head revision
        with ledger.engine.connect() as conn:
            assert MigrationContext.configure(conn).get_current_revision() == head_revision()
            assert conn.execute(text("SELECT controller, policy_name FROM runs")).all() == [("joint", None)]
        [row] = overview_runs(ledger, RunFilter(policies=("joint",)))
        assert (row["policy"], row["controller"]) == ("joint", "joint")

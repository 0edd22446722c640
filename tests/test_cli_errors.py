"""Bad inputs through the command line: a clear message on stderr, exit status 2, nothing half written.

The ledger layer's own errors are tested in test_ledger_db.py and the gate command's run-id / URL errors
in test_gate.py; these cover what reaches a user of ``fallbackgate run`` and ``fallbackgate gate``.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import sqlite3
import subprocess
import sys

import pytest

from fallbackgate.cli import main
from fallbackgate.ledger.db import ENV_VAR, open_ledger
from fallbackgate.ledger.writer import LedgerWriter
from tests.pg_fixture import free_port

REPO = pathlib.Path(__file__).resolve().parents[1]


def _digest(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _run(model: pathlib.Path, ledger: str, *extra: str) -> int:
    return main(["run", "--model", str(model), "--ledger", ledger, "--max-new-tokens", "2", "--quiet", *extra])


def _error(capsys: pytest.CaptureFixture[str], command: str = "run") -> str:
    captured = capsys.readouterr()
    assert "request" not in captured.out, "nothing may be served after a bad input"
    lines = captured.err.strip().splitlines()
    assert lines and lines[-1].startswith(f"fallbackgate {command}: error: "), captured.err
    assert "Traceback" not in captured.err
    return lines[-1]


def _ledger_with_run(path: pathlib.Path) -> None:
    with open_ledger(str(path)) as ledger, LedgerWriter(ledger) as writer:
        writer.start_run(model_path="x")
        writer.finish_run()


@pytest.fixture(autouse=True)
def _no_env_ledger(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.chdir(tmp_path)  # a default ./fallbackgate-ledger.sqlite would show up here


def test_run_unreachable_postgres(checkpoint_factory, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"postgresql+psycopg://fg@127.0.0.1:{free_port()}/ledger"
    assert _run(checkpoint_factory("qwen3_moe"), url) == 2
    message = _error(capsys)
    assert "cannot open ledger" in message and "127.0.0.1" in message


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("postgresql:/nohost/db", "malformed ledger URL"),
        ("postgresql+psycopg://u@host:notaport/db", "malformed ledger URL"),
        ("nosuchdb://host/db", "unknown database kind"),
        ("missing-dir/x.sqlite", "does not exist"),
    ],
)
def test_run_malformed_ledger_url(
    url: str, expected: str, checkpoint_factory, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(checkpoint_factory("qwen3_moe"), url) == 2
    assert expected in _error(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_run_and_gate_refuse_a_newer_schema_untouched(
    checkpoint_factory, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "l.sqlite"
    _ledger_with_run(path)
    con = sqlite3.connect(path)
    con.execute("UPDATE alembic_version SET version_num = '9999_from_the_future'")
    con.commit()
    con.close()
    before = _digest(path)
    assert _run(checkpoint_factory("qwen3_moe"), str(path)) == 2
    assert "newer than this fallbackgate knows" in _error(capsys)
    assert main(["gate", "--ledger", str(path)]) == 2
    assert "newer than this fallbackgate knows" in _error(capsys, "gate")
    assert _digest(path) == before


def test_run_refuses_a_read_only_ledger_untouched(
    checkpoint_factory, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "l.sqlite"
    _ledger_with_run(path)
    path.chmod(0o444)
    before = _digest(path)
    try:
        assert _run(checkpoint_factory("qwen3_moe"), str(path)) == 2
        assert "read-only" in _error(capsys)
        assert main(["gate", "--ledger", str(path)]) == 1  # reading a read-only ledger is fine; the run is
        out = capsys.readouterr().out  # empty, and an empty run never passes
        assert "run 1 (complete" in out and "run has no requests" in out
        assert main(["gate", "--ledger", str(path), "--run", "7"]) == 2
        assert "no run 7" in _error(capsys, "gate")
    finally:
        path.chmod(0o644)
    assert _digest(path) == before
    wal = tmp_path / "l.sqlite-wal"  # SQLite readers of a WAL ledger may leave an empty -wal (and -shm)
    assert not wal.exists() or wal.stat().st_size == 0


@pytest.mark.parametrize("kind", ["missing", "empty", "not_a_model"])
def test_run_bad_model_dir(kind: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model"
    if kind != "missing":
        model.mkdir()
    if kind == "not_a_model":
        (model / "config.json").write_text("{not json")
    ledger = tmp_path / "l.sqlite"
    assert _run(model, str(ledger)) == 2
    assert str(model) in _error(capsys)
    assert not ledger.exists()


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('{"prompt": "hi"}\n{"prompt": \n', "prompts.jsonl:2: not valid JSON"),
        ('{"prompt": ""}\n', "prompts.jsonl:1: field 'prompt' must be a non-empty string"),
        ('{"prompt": "a", "max_new_tokens": 0}\n', "field 'max_new_tokens' must be a positive integer"),
        ('{"prompt": "a", "colour": "red"}\n', "unknown field(s) ['colour']"),
        ("\n\n", "no prompts"),
        (None, "does not exist"),
    ],
)
def test_run_bad_prompts_file(
    content: str | None, expected: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    if content is not None:
        prompts.write_text(content)
    ledger = tmp_path / "l.sqlite"
    assert _run(tmp_path / "never-loaded", str(ledger), "--prompts", str(prompts)) == 2
    assert expected in _error(capsys)
    assert not ledger.exists()


def test_exit_status_of_the_process(tmp_path: pathlib.Path) -> None:
    """The installed entry point's process really exits 2 with one error line."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps(["not", "an", "object"]) + "\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(ENV_VAR, None)
    proc = subprocess.run(
        [sys.executable, "-m", "fallbackgate.cli", "run", "--prompts", str(prompts), "--ledger", "x.sqlite"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"fallbackgate run: error: {prompts}:1: expected a JSON object, got list"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl"]

"""kill -9 of a running ``fallbackgate run``: the SQLite ledger stays intact, keeps every step committed
before the kill with all its events, shows the run incomplete, and ``fallbackgate gate`` fails it."""

from __future__ import annotations

import os
import pathlib
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from fallbackgate.cli import main
from fallbackgate.ledger import queries
from fallbackgate.ledger.db import ENV_VAR, open_ledger

REPO = pathlib.Path(__file__).resolve().parents[1]
MIN_STEPS = 15  # steps committed before the kill


def _count_steps(path: pathlib.Path) -> int:
    if not path.exists():
        return 0
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            return int(con.execute("SELECT count(*) FROM steps").fetchone()[0])
        finally:
            con.close()
    except sqlite3.OperationalError:  # schema not created yet
        return 0


def _start_run(model: pathlib.Path, ledger: pathlib.Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(ENV_VAR, None)
    command = [sys.executable, "-m", "fallbackgate.cli", "run", "--model", str(model), "--ledger", str(ledger)]
    command += ["--max-new-tokens", "400", "--block-size", "4", "--device-budget-mb", "0.6", "--quiet"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)


def _kill_after_steps(proc: subprocess.Popen[str], ledger: pathlib.Path) -> int:
    """SIGKILL once at least MIN_STEPS steps are committed; returns how many were seen just before."""
    deadline = time.monotonic() + 120
    seen = 0
    while seen < MIN_STEPS:
        assert proc.poll() is None, f"run exited early ({proc.returncode}): {proc.stderr.read()}"
        assert time.monotonic() < deadline, f"only {seen} steps committed after 120 s"
        time.sleep(0.1)
        seen = _count_steps(ledger)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    return seen


def test_kill_9_of_fallbackgate_run(
    checkpoint_factory, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger = tmp_path / "run.sqlite"
    proc = _start_run(checkpoint_factory("qwen3_moe"), ledger)
    try:
        seen = _kill_after_steps(proc, ledger)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL

    con = sqlite3.connect(ledger)
    assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    assert con.execute("PRAGMA foreign_key_check").fetchall() == []
    step_ids = [s for (s,) in con.execute("SELECT step_id FROM steps ORDER BY step_id")]
    assert len(step_ids) >= seen and step_ids[0] <= 1
    assert step_ids == list(range(step_ids[0], step_ids[0] + len(step_ids)))  # no gap: committed in order
    with_events = {s for (s,) in con.execute("SELECT DISTINCT step_id FROM events")}
    assert with_events == set(step_ids)  # every committed step has its events, no orphan events
    assert con.execute("SELECT count(*) FROM requests").fetchone() == (0,)  # nothing had finished
    assert con.execute("SELECT status, finished_at FROM runs").fetchall() == [("running", None)]
    con.close()

    with open_ledger(str(ledger), read_only=True) as opened:
        (run,) = queries.list_runs(opened)
        assert run["status"] == "incomplete"
    assert main(["gate", "--ledger", str(ledger)]) == 1
    out = capsys.readouterr().out
    assert f"run {run['id']} (incomplete" in out and "FAIL: run is incomplete" in out

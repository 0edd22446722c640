"""kill -9 mid-run: the SQLite ledger stays consistent, keeps every flushed event, shows the run incomplete."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from fallbackgate.ledger import queries
from fallbackgate.ledger.db import open_ledger

REPO = Path(__file__).resolve().parents[1]
EVENTS_PER_STEP = 3 * 4 * 2  # requests × layers × events per layer

SCRIPT = textwrap.dedent(
    """
    import sys
    from fallbackgate.ledger.db import open_ledger
    from fallbackgate.ledger.synthetic import synthetic_step
    from fallbackgate.ledger.writer import LedgerWriter

    w = LedgerWriter(open_ledger(sys.argv[1]), flush_interval_s=0.01, batch_size=200)
    w.start_run(model_path="crash-test")
    step = 0
    while True:
        for _ in range(20):
            w.record_step(*synthetic_step(step, ["a", "b", "c"], num_layers=4, events_per_layer=2))
            step += 1
        w.flush()
        print(step, flush=True)  # every step below this is committed
    """
)


def test_kill_9_leaves_consistent_incomplete_ledger(tmp_path: Path) -> None:
    path = tmp_path / "crash.sqlite"
    script = tmp_path / "writer.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(path)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    flushed = 0
    deadline = time.monotonic() + 60
    while flushed < 100 and time.monotonic() < deadline:  # at least 5 flushes, then keep it writing
        line = proc.stdout.readline()
        assert line, f"writer exited early with {proc.wait()}"
        flushed = int(line)
    time.sleep(0.05)  # let it get into the middle of more batches
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for line in proc.stdout:  # anything printed before the kill was flushed too
        flushed = int(line)

    con = sqlite3.connect(path)
    assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    assert con.execute("PRAGMA foreign_key_check").fetchall() == []
    n_steps, n_events = con.execute("SELECT (SELECT count(*) FROM steps), (SELECT count(*) FROM events)").fetchone()
    assert n_steps >= flushed and n_events >= flushed * EVENTS_PER_STEP
    # each step was written whole, in one transaction with its events: no step is half there
    per_step = con.execute("SELECT step_id, count(*) FROM events GROUP BY step_id").fetchall()
    assert len(per_step) == n_steps and {n for _, n in per_step} == {EVENTS_PER_STEP}
    assert con.execute("SELECT status, finished_at FROM runs").fetchall() == [("running", None)]
    con.close()
    with open_ledger(str(path), read_only=True) as ledger:
        (run,) = queries.list_runs(ledger)
        assert run["status"] == "incomplete"


def test_normal_exit_without_close_writes_everything(tmp_path: Path) -> None:
    path = tmp_path / "exit.sqlite"
    script = textwrap.dedent(
        """
        import sys
        from fallbackgate.ledger.db import open_ledger
        from fallbackgate.ledger.synthetic import synthetic_step
        from fallbackgate.ledger.writer import LedgerWriter

        w = LedgerWriter(open_ledger(sys.argv[1]), flush_interval_s=60.0)
        w.start_run()
        for step in range(30):
            w.record_step(*synthetic_step(step, ["a"], num_layers=2, events_per_layer=1))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", script, str(path)], check=True, env=env, timeout=60)
    con = sqlite3.connect(path)
    assert con.execute("SELECT count(*) FROM events").fetchone() == (60,)
    assert con.execute("SELECT status FROM runs").fetchone() == ("running",)  # never finished: incomplete

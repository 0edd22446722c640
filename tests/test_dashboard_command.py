"""`fallbackgate dashboard` stops its Streamlit child when it is stopped, and never prints a password."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

from tests.pg_fixture import free_port


def _health(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=1) as r:
            return r.read() == b"ok"
    except OSError:
        return False


def test_sigterm_stops_the_streamlit_child(tmp_path) -> None:
    port = free_port()
    ledger = "postgresql+psycopg://fg:s3cret-pw@127.0.0.1:1/ledger"  # never reached: the page shows an error
    cmd = [sys.executable, "-m", "fallbackgate", "dashboard", "--port", str(port), "--ledger", ledger]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not _health(port):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()
            time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        deadline = time.monotonic() + 15
        while _health(port):  # the child went with it
            assert time.monotonic() < deadline, "streamlit still serving after the command stopped"
            time.sleep(0.3)
        text = out.decode()
        assert "s3cret" not in text and "fg:***@" in text, text
        assert proc.returncode == 0 and "Traceback" not in text, text  # asked to stop: a clean exit
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)

"""``fallbackgate serve`` on a PostgreSQL ledger that is restarted under load (``pg_ctl stop -m fast``, away
until the records waiting reach the buffer bound and a second more, start): requests go on being served while
the records fit the buffer, get 503 with Retry-After once they do not, and afterwards every answered request
has exactly one row, every step all its events and request rows, every deferred audit is done by the worker
that rode out the restart, and the run is complete and judged."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from sqlalchemy import func, select

from fallbackgate.ledger import audit_queries, audit_queue, queries
from fallbackgate.ledger.db import open_ledger
from fallbackgate.ledger.models import Request
from tests.pg_cluster import pg_cluster
from tests.test_server import MODEL, Server

MAX_OUTAGE_S = 30.0  # the ledger stays away until the buffer is full (a few seconds here), at most this long
BUFFER_MB = "8"  # records held meanwhile (about 0.5-6 MB/s here, every request audited): a few seconds of them
BUFFER_BYTES = 8 * 2**20


class Clients:
    """Four clients sending completions until told to stop; a 503 is retried after a short wait."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.answered: list[tuple[float, str]] = []  # (monotonic time, request id) of each 200
        self.refused: list[tuple[float, str | None]] = []  # (monotonic time, Retry-After) of each 503
        self.other: list[int] = []  # any other status
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,)) for i in range(4)]
        for t in self.threads:
            t.start()

    def _client(self, i: int) -> None:
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                body = {"model": MODEL, "prompt": f"Client {i} says hello", "max_tokens": 8}
                r = client.post(f"{self.base}/v1/completions", json=body)
                if r.status_code == 200:
                    self.answered.append((time.monotonic(), r.json()["id"]))
                elif r.status_code == 503:
                    self.refused.append((time.monotonic(), r.headers.get("retry-after")))
                    time.sleep(0.2)  # sooner than Retry-After: the test has no time to spare
                else:
                    self.other.append(r.status_code)

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


@pytest.mark.slow
def test_a_postgresql_restart_under_load_loses_and_duplicates_nothing() -> None:
    with pg_cluster() as cluster:
        srv = Server(cluster.url, "--audit-workers", "1", "--ledger-buffer-mb", BUFFER_MB)
        clients = Clients(srv.base)
        while len(clients.answered) < 12:
            time.sleep(0.05)
        cluster.stop()
        down = time.monotonic()
        seen_retrying: float | None = None  # when /health first said the ledger was away
        while not (during := httpx.get(f"{srv.base}/health").json())["ledger"]["buffered_bytes"] >= BUFFER_BYTES:
            assert time.monotonic() < down + MAX_OUTAGE_S, during  # the records must reach the bound meanwhile
            if seen_retrying is None and during["ledger"]["is_retrying"]:
                seen_retrying = time.monotonic()
            time.sleep(0.2)
        seen_retrying = seen_retrying or time.monotonic()
        time.sleep(1.0)  # refusals while the buffer is full
        metrics = httpx.get(f"{srv.base}/metrics").text
        cluster.start()
        up = time.monotonic()
        num_before_up = len(clients.answered)
        while len(clients.answered) < num_before_up + 12:
            time.sleep(0.05)
        clients.join()
        out = srv.stop()
        assert srv.proc.returncode == 0 and "Traceback" not in out and "0 request(s) interrupted" in out, out

        assert during["status"] == "ok" and during["ledger"]["is_retrying"], during
        assert 0 < during["ledger"]["outage_s"] < time.monotonic() - down, during
        assert during["ledger"]["buffer_bytes"] == BUFFER_BYTES, during
        assert "fallbackgate_ledger_retrying 1.0" in metrics and "fallbackgate_ledger_buffered_bytes" in metrics
        served_while_down = [rid for t, rid in clients.answered if seen_retrying < t < up]
        assert served_while_down, "nothing was served while the ledger was away"
        assert clients.refused and all(after == "5" for _, after in clients.refused), clients.refused
        assert all(down < t < up + 5.0 for t, _ in clients.refused)  # refused only while the buffer was full
        assert not clients.other, clients.other

        with open_ledger(cluster.url) as ledger:
            (run,) = queries.list_runs(ledger)
            assert run["status"] == "complete", run
            with ledger.engine.connect() as conn:
                rows = conn.execute(select(Request.request_id, func.count()).group_by(Request.request_id)).all()
            counts = dict(rows)
            answered = {rid for _, rid in clients.answered}
            assert set(counts) == answered and set(counts.values()) == {1}  # exactly one row each
            for found in (audit_queries.step_event_counts, audit_queries.step_row_counts):
                per_step = found(ledger, run["id"])
                assert per_step and all(s["expected"] == s["found"] for s in per_step)
            tasks = audit_queue.task_counts(ledger, run["id"])
            assert set(tasks) == {"done"} and tasks["done"] >= 2, tasks  # requests' tasks and the run's
            assert any(v["request_id"] is None for v in queries.verdicts(ledger, run["id"]))

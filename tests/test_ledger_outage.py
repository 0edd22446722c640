"""The ledger writer against a real PostgreSQL server that goes away: stopped (fast shutdown) and started
again under writes, a COMMIT cut off after it landed, a statement cut off before, and the buffer bound.
Every row recorded is found exactly once afterwards."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterator

import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import OperationalError

from fallbackgate.ledger import writer_thread
from fallbackgate.ledger.db import Ledger, open_ledger
from fallbackgate.ledger.models import Calibration
from fallbackgate.ledger.writer import LedgerWriter
from tests.pg_cluster import Cluster, pg_cluster


@pytest.fixture(name="shared_cluster", scope="module")
def shared_cluster_fixture() -> Iterator[Cluster]:
    with pg_cluster() as cluster:
        yield cluster


@pytest.fixture(name="url")
def url_fixture(shared_cluster: Cluster) -> str:
    """A fresh database on the module's cluster (running: every test that stops it starts it again)."""
    return shared_cluster.new_database(f"fg_{next(_databases)}")


_databases = itertools.count()


def _record(writer: LedgerWriter, layers: range) -> None:
    for layer in layers:
        writer.record_calibration("resident", layer, 1.0, 1, [writer.run_id])


def _layers(ledger: Ledger) -> list[int]:
    with ledger.engine.connect() as conn:
        return list(conn.execute(select(Calibration.layer).order_by(Calibration.layer)).scalars())


def _lost_connection() -> OperationalError:
    return OperationalError("COMMIT", {}, Exception("server closed the connection unexpectedly"), True)


def test_writes_through_a_server_restart_land_exactly_once(shared_cluster: Cluster, url: str) -> None:
    cluster = shared_cluster
    with open_ledger(url) as ledger:
        writer = LedgerWriter(ledger, flush_interval_s=0.02)
        writer.start_run(note="restart")
        done = threading.Event()
        num_recorded = [0]

        def record() -> None:
            while not done.is_set():
                _record(writer, range(num_recorded[0], num_recorded[0] + 10))
                num_recorded[0] += 10
                time.sleep(0.005)

        thread = threading.Thread(target=record)
        thread.start()
        time.sleep(0.5)
        cluster.stop()
        time.sleep(2.0)
        during = writer.buffer_state()
        cluster.start()
        time.sleep(0.5)
        done.set()
        thread.join()
        writer.flush()
        after = writer.buffer_state()
        writer.close()
        assert during.is_retrying and during.buffered_bytes > 0 and during.outage_s > 1.0, during
        assert during.last_error is not None
        assert not after.is_retrying and after.buffered_bytes == 0 and after.num_retries > 0, after
        assert _layers(ledger) == list(range(num_recorded[0]))  # none lost, none twice


def _cut_off_once(real, when: str, calls: list[str], leaked: list):  # noqa: ANN001, ANN202 - wraps begin_write
    """A begin_write whose first transaction is cut off: "after_commit" (committed, then the acknowledgement
    is lost), "before_commit" (rolled back) or "in_progress" (the session stays open, its transaction too)."""

    @contextlib.contextmanager
    def begin_write(engine):  # noqa: ANN001, ANN202
        is_first = not calls
        calls.append(when)
        if is_first and when == "in_progress":
            conn = engine.connect()
            leaked.append(conn)
            conn.begin()
            yield conn
            raise _lost_connection()
        with real(engine) as conn:
            yield conn
            if is_first and when == "before_commit":
                raise _lost_connection()  # inside the transaction: it rolls back
        if is_first and when == "after_commit":
            raise _lost_connection()

    return begin_write


@pytest.mark.parametrize("when", ["after_commit", "before_commit", "in_progress"])
def test_a_cut_off_batch_is_written_once(url: str, monkeypatch: pytest.MonkeyPatch, when: str) -> None:
    with open_ledger(url) as ledger:
        writer = LedgerWriter(ledger, flush_interval_s=0.02)
        writer.start_run(note=when)
        calls: list[str] = []
        leaked: list = []
        monkeypatch.setattr(writer_thread, "begin_write", _cut_off_once(writer_thread.begin_write, when, calls, leaked))
        _record(writer, range(50))
        writer.flush()
        monkeypatch.undo()
        state = writer.buffer_state()
        writer.close()
        assert state.num_retries >= 1, state
        # after_commit: asked (txid_status), found committed, not written again; before_commit: written again;
        # in_progress: its session ended (pg_terminate_backend), then found aborted and written again
        assert len(calls) == (1 if when == "after_commit" else 2), calls
        assert _layers(ledger) == list(range(50))
        if leaked:
            with pytest.raises(OperationalError):  # the lost session was ended by the writer
                leaked[0].execute(select(1))
            with contextlib.suppress(Exception):
                leaked[0].close()


def test_the_buffer_bound_is_measured_and_reached(shared_cluster: Cluster, url: str) -> None:
    cluster = shared_cluster
    with open_ledger(url) as ledger:
        writer = LedgerWriter(ledger, flush_interval_s=0.02, buffer_bytes=50_000)
        writer.start_run(note="bound")
        cluster.stop()
        num = 0
        deadline = time.monotonic() + 20
        while not writer.is_buffer_full:
            assert time.monotonic() < deadline, writer.buffer_state()
            _record(writer, range(num, num + 20))
            num += 20
            time.sleep(0.01)
        full = writer.buffer_state()
        cluster.start()
        writer.flush()
        after = writer.buffer_state()
        writer.close()
        assert full.buffered_bytes >= 50_000 and full.buffer_bytes == 50_000 and full.num_batches >= 1, full
        # measured: each calibration row (a tuple of scalars and a one-item list) is a few hundred bytes
        assert 100 <= full.buffered_bytes / num <= 2000, full.buffered_bytes / num
        assert after.buffered_bytes == 0 and not writer.is_buffer_full
        assert _layers(ledger) == list(range(num))
        with ledger.engine.connect() as conn:
            assert conn.execute(select(func.count()).select_from(Calibration)).scalar_one() == num


def test_close_while_the_server_is_away_waits_for_it_and_writes_everything(shared_cluster: Cluster, url: str) -> None:
    with open_ledger(url) as ledger:
        writer = LedgerWriter(ledger, flush_interval_s=0.02)
        writer.start_run(note="close")
        shared_cluster.stop()
        _record(writer, range(30))
        time.sleep(0.5)  # the first write has failed: the rows wait
        assert writer.buffer_state().is_retrying
        later = threading.Timer(1.5, shared_cluster.start)
        later.start()
        writer.close()  # the stop arrives during the outage: it waits, then writes
        later.join()
        assert _layers(ledger) == list(range(30))

"""Deferred audits: served logits and tasks left in the ledger, claimed and done by audit workers.

Workers claim with SKIP LOCKED on PostgreSQL, hold a lease they renew, and write only under a live fencing
token: every request is audited exactly once even when a worker dies mid-task or outlives its lease.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from sqlalchemy import func, select

from fallbackgate.audit import auditor
from fallbackgate.audit.replay_trace import TraceError
from fallbackgate.audit.worker import AuditWorker
from fallbackgate.batch.session import RunSettings
from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.engine import Engine
from fallbackgate.ledger import audit_queue, queries
from fallbackgate.ledger.audit_queue import LeaseLost
from fallbackgate.ledger.db import open_ledger
from fallbackgate.ledger.models import AuditTask, PositionDiffRow, RequestStatRow, VerdictRow
from fallbackgate.ledger.writer import LedgerWriter
from fallbackgate.recording import RunRecorder, RunRow, as_specs, record_and_judge
from tests.checkpoints import make_checkpoint
from tests.pg_fixture import pg_server_fixture, pg_url_fixture  # noqa: F401 - fixtures
from tests.test_engine_exact import sizes

WORDS = "once upon a time the quick brown fox jumps over lazy dog princess lived in castle".split()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("workers-qwen3"), seed=0)


def _engine(model: pathlib.Path, force: tuple[str, ...] = ()) -> Engine:
    expert, block, layers, _ = sizes(model)
    config = EngineConfig(
        model_dir=str(model), block_size=4, max_num_seqs=8, device_budget_bytes=6 * expert + 40 * layers * block
    )
    return Engine(config, ExactLRUController(force))


def _prompts(n: int) -> list[str]:
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(1 + i % 6)) for i in range(n)]


def _serve_deferred(model: pathlib.Path, url: str, num_requests: int, force: tuple[str, ...] = ()) -> int:
    engine = _engine(model, force)
    settings = RunSettings(model_dir=str(model), max_new_tokens=5)
    with open_ledger(url) as ledger:
        recorder = RunRecorder(LedgerWriter(ledger), engine, RunRow(controller="exact_lru"))
        outcome = recorder.serve(as_specs(_prompts(num_requests)), settings)
        verdict = recorder.finish(outcome, is_deferred=True)
        assert verdict is None and recorder.num_deferred == num_requests
    return recorder.run_id


def _stats(url: str, run_id: int) -> list[dict]:
    with open_ledger(url) as ledger:
        return sorted(queries.request_summaries(ledger, run_id), key=lambda r: r["request_id"])


def test_deferred_audit_by_a_worker_matches_the_inline_audit(model: pathlib.Path, tmp_path: pathlib.Path) -> None:
    deferred_url = str(tmp_path / "deferred.sqlite")
    run_id = _serve_deferred(model, deferred_url, 4, ("expert_defer",))
    with open_ledger(deferred_url) as ledger:
        assert not queries.verdicts(ledger, run_id)  # nothing judged yet ...
        stats = AuditWorker(ledger, lease_s=30).run()
        assert (stats.num_requests, stats.num_runs, stats.num_lost) == (4, 1, 0)
        run_verdicts = [v for v in queries.verdicts(ledger, run_id) if v["request_id"] is None]
        assert len(run_verdicts) == 1 and run_verdicts[0]["passed"], run_verdicts
    inline = record_and_judge(
        _engine(model, ("expert_defer",)),
        _prompts(4),
        str(tmp_path / "inline.sqlite"),
        settings=RunSettings(model_dir=str(model), max_new_tokens=5),
    )
    for got, want in zip(
        _stats(deferred_url, run_id), _stats(str(tmp_path / "inline.sqlite"), inline.run_id), strict=True
    ):
        assert got["request_id"] == want["request_id"]
        assert got["max_kl"] == pytest.approx(want["max_kl"], rel=1e-6, abs=1e-12)
        assert got["replay_max_kl"] == pytest.approx(want["replay_max_kl"], rel=1e-3, abs=1e-12)
        assert got["verdict"] == want["verdict"] == "pass"


def test_a_worker_keeps_the_replays_reason_when_it_cannot_follow_a_trace(
    model: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = str(tmp_path / "l.sqlite")
    run_id = _serve_deferred(model, url, 2, ("expert_defer",))  # approximate: every request is replayed
    why = "request prompt-0: step 3 starts at position 9 but only 7 were computed before it (planted)"

    def unfollowable(*args, **kwargs):
        raise TraceError(why)

    monkeypatch.setattr(auditor, "load_trace", unfollowable)
    with open_ledger(url) as ledger:
        assert AuditWorker(ledger, lease_s=30).run().num_requests == 2
    for row in _stats(url, run_id):
        assert row["replay_error"] == why and row["verdict"] == "fail", row
    with open_ledger(url, read_only=True) as ledger:
        verdicts = [v for v in queries.verdicts(ledger, run_id) if v["request_id"] is not None]
    assert len(verdicts) == 2 and all(f"cannot follow the recorded actions: {why}" in v["reason"] for v in verdicts)


def test_a_slow_first_worker_cannot_write_a_second_verdict(model: pathlib.Path, tmp_path: pathlib.Path) -> None:
    url = str(tmp_path / "l.sqlite")
    run_id = _serve_deferred(model, url, 2)
    with open_ledger(url) as ledger:
        slow = AuditWorker(ledger, lease_s=0.2)
        held = audit_queue.claim(ledger, "slow", 0.2, run_id)
        assert held is not None and held.token == 1
        time.sleep(0.3)  # its lease runs out while it still works
        fast = AuditWorker(ledger, lease_s=30)
        assert fast.run(max_tasks=1).num_requests == 1  # takes the expired task over (token 2) and finishes it
        with pytest.raises(LeaseLost, match="token 1 is stale"):
            slow.do(held)
        with ledger.engine.connect() as conn:
            task = conn.execute(
                select(AuditTask.__table__).where(AuditTask.run_id == run_id, AuditTask.request_id == held.request_id)
            ).one()
            num_stats = conn.execute(
                select(func.count()).where(
                    RequestStatRow.run_id == run_id, RequestStatRow.request_id == held.request_id
                )
            ).scalar_one()
        assert (task.state, task.fencing_token, task.num_attempts, num_stats) == ("done", 2, 2, 1)


@pytest.mark.slow
def test_three_workers_on_postgresql_one_killed(model: pathlib.Path, pg_url: str) -> None:
    num_requests = 60
    run_id = _serve_deferred(model, pg_url, num_requests)
    cmd = [sys.executable, "-m", "fallbackgate", "audit", "--ledger", pg_url, "--lease-s", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = lambda: subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # noqa: E731
    victim = start()  # starts first, so it holds claims before the others can take every task
    with open_ledger(pg_url) as ledger:
        held_by_victim = _freeze_holding_a_claim(ledger, victim)
        procs = [victim, start(), start()]
        os.kill(victim.pid, signal.SIGKILL)  # dies holding the claim; its lease must expire
        victim.wait(timeout=30)
        for proc in procs[1:]:
            out, _ = proc.communicate(timeout=300)
            assert proc.returncode == 0, out.decode()
        with ledger.engine.connect() as conn:
            tasks = conn.execute(select(AuditTask.__table__).where(AuditTask.run_id == run_id)).all()
            stats = conn.execute(
                select(RequestStatRow.request_id, func.count())
                .where(RequestStatRow.run_id == run_id)
                .group_by(RequestStatRow.request_id)
            ).all()
            diffs = conn.execute(select(func.count()).where(PositionDiffRow.run_id == run_id)).scalar_one()
            run_verdicts = conn.execute(
                select(func.count()).where(VerdictRow.run_id == run_id, VerdictRow.request_id.is_(None))
            ).scalar_one()
        verdict_rows = queries.verdicts(ledger, run_id)
    assert len(tasks) == num_requests + 1 and {t.state for t in tasks} == {"done"}
    assert len(stats) == num_requests and all(n == 1 for _, n in stats)  # each request audited exactly once
    assert diffs == 5 * num_requests and run_verdicts == 1
    taken_over = next(t for t in tasks if t.request_id == held_by_victim)
    assert taken_over.num_attempts == 2 and taken_over.worker != f"{os.uname().nodename}:{victim.pid}"
    assert all(v["passed"] for v in verdict_rows), [v for v in verdict_rows if not v["passed"]]
    workers = {t.worker for t in tasks}
    assert len(workers) >= 2, workers  # the survivors shared the work


def _claimed_by(ledger, proc: subprocess.Popen) -> list[str]:
    with ledger.engine.connect() as conn:
        stmt = select(AuditTask.request_id).where(AuditTask.state == "claimed", AuditTask.worker.like(f"%:{proc.pid}"))
        return list(conn.execute(stmt).scalars())


def _freeze_holding_a_claim(ledger, proc: subprocess.Popen) -> str:
    """Stop `proc` at a moment it holds a claimed task; return that task's request id. It runs freely until
    it is seen holding one, then is stopped and the claim confirmed (else it goes on and we look again)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the worker exited: {proc.stdout.read().decode()}")
        if _claimed_by(ledger, proc):
            os.kill(proc.pid, signal.SIGSTOP)
            held = _claimed_by(ledger, proc)
            if held:
                return held[0]
            os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.02)
    raise AssertionError("the worker never held a claim")

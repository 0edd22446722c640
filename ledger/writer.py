"""Batched background writer: the decode loop hands over messages and never waits on the database.

Callers put messages on a bounded queue (``put`` blocks only when it is full); one background thread
(:mod:`fallbackgate.ledger.writer_thread`) turns them into rows and writes them with bulk inserts, one transaction
per batch, every ``flush_interval_s`` or as soon as ``batch_size`` rows are pending. A process killed mid-run leaves
every batch committed so far and the run still "running" (reported as incomplete). A PostgreSQL ledger that goes
away (restarted, unreachable) for up to ``retry_s`` loses nothing: batches wait in memory, measured against
``buffer_bytes``, and are written once, in order, when it answers again.

The writer keeps references to the recorded messages until they are written: do not mutate them.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Self

from sqlalchemy import delete, insert, update

from fallbackgate.engine.messages import RequestOutput, StepPlan, StepResult
from fallbackgate.ledger.backlog import DEFAULT_BUFFER_BYTES, BufferState
from fallbackgate.ledger.db import Ledger, LedgerError, begin_write
from fallbackgate.ledger.models import RUN_STATUSES, EventRow, Run, utcnow
from fallbackgate.ledger.retry import DEFAULT_RETRY_S
from fallbackgate.ledger.writer_results import ResultRecording, run_update
from fallbackgate.ledger.writer_thread import (
    FLUSH,
    FlushMessage,
    ForgetMessage,
    GroupMessage,
    Message,
    OpMessage,
    RequestMessage,
    StepMessage,
    WriterThread,
)


class LedgerWriter(ResultRecording):
    """Writes one run's steps, events, requests, diffs and verdicts to a ledger in the background."""

    def __init__(
        self,
        ledger: Ledger,
        *,
        batch_size: int = 20_000,
        flush_interval_s: float = 0.2,
        max_queue: int = 10_000,
        handoff_steps: int = 16,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        retry_s: float = DEFAULT_RETRY_S,
    ) -> None:
        if ledger.read_only:
            raise LedgerError(f"ledger {ledger.display_url} was opened read-only; cannot write")
        self.ledger = ledger
        self.handoff_steps = handoff_steps  # steps held by the caller before one wake-up of the thread
        self._held: list[Message] = []  # steps not yet handed to the thread; it also takes them when idle
        self._held_lock = threading.Lock()
        self.run_id: int | None = None
        self._closed = False
        self._writer = WriterThread(
            ledger,
            self._take_held,
            batch_size=batch_size,
            flush_interval_s=flush_interval_s,
            max_queue=max_queue,
            buffer_bytes=buffer_bytes,
            retry_s=retry_s,
        )
        atexit.register(self._close_at_exit)  # a normal interpreter exit still writes what was recorded

    # ---- caller side -------------------------------------------------------------------------
    def buffer_state(self) -> BufferState:
        """Where writes stand: retrying after a lost connection, and the measured bytes waiting."""
        return self._writer.backlog.state()

    @property
    def is_buffer_full(self) -> bool:
        """True while the rows waiting for an absent database reach ``buffer_bytes`` (a server then refuses
        new requests rather than serve them unrecorded)."""
        return self._writer.backlog.is_full

    def start_run(
        self,
        *,
        policy: str | None = None,
        policy_name: str | None = None,
        model_path: str | None = None,
        hardware_profile: Mapping[str, Any] | None = None,
        versions: Mapping[str, Any] | None = None,
        controller: str | None = None,
        mode: str | None = None,
        note: str | None = None,
        forced_tags: Sequence[str] | None = None,
        trace_path: str | None = None,
    ) -> int:
        """Insert a run row with status "running" (synchronously) and make it the current run (`trace_path`: the
        directory its trace is written to, when one is)."""
        self._check()
        row = {
            "started_at": utcnow(),
            "status": "running",
            "policy": policy,
            "policy_name": policy_name,
            "model_path": model_path,
            "hardware_profile": dict(hardware_profile) if hardware_profile is not None else None,
            "versions": dict(versions) if versions is not None else None,
            "controller": controller,
            "mode": mode,
            "note": note,
            "forced_tags": list(forced_tags) if forced_tags else None,
            "trace_path": trace_path,
        }
        with begin_write(self.ledger.engine) as conn:
            run_id = conn.execute(insert(Run.__table__).returning(Run.__table__.c.id), row).scalar_one()
        self.run_id = int(run_id)
        return self.run_id

    def record_step(self, plan: StepPlan, result: StepResult, *, run_id: int | None = None) -> None:
        """Record one step row and all of its events.

        Steps are handed to the writer thread in groups of `handoff_steps` (the thread also collects them
        after `flush_interval_s` of quiet), so the decode loop rarely wakes it; a crash loses at most the
        steps of the last `flush_interval_s`.
        """
        with self._held_lock:
            self._held.append(StepMessage(self._run(run_id), plan, result))
            is_due = len(self._held) >= self.handoff_steps
        if is_due:
            self._handoff()

    def _take_held(self) -> list[Message]:
        with self._held_lock:
            held, self._held = self._held, []
        return held

    def _handoff(self) -> None:
        held = self._take_held()
        if held:
            self._put_now(GroupMessage(held))

    def record_request(
        self,
        output: RequestOutput,
        *,
        slo: Mapping[str, Any] | None = None,
        budget: Mapping[str, Any] | None = None,
        prompt: str | None = None,
        run_id: int | None = None,
        status: str = "finished",
    ) -> None:
        """Record a request that ended with ``status`` ("finished", or "cancelled": what it had produced when
        the server shut down) with its class, SLO, quality budget and timings."""
        self._put(RequestMessage(self._run(run_id), output, slo, budget, prompt, status))

    def forget_request(self, request_id: str, *, run_id: int | None = None) -> None:
        """No diffs will be recorded through this writer for ``request_id`` (a server leaves its audits to
        workers): release what the writer tracks for it (the steps that sampled its tokens)."""
        self._put(ForgetMessage(self._run(run_id), request_id))

    def finish_run(self, run_id: int | None = None, status: str = "complete") -> None:
        """Mark the run finished with ``status`` and wait until everything recorded is written."""
        if status not in RUN_STATUSES or status == "running":
            raise ValueError(f"finish status must be one of complete/failed/incomplete, not {status!r}")
        rid = self._run(run_id)
        self._put(OpMessage(run_update(rid, status=status, finished_at=utcnow())))
        self.flush()

    def mark_run_now(self, status: str, run_id: int | None = None) -> bool:
        """Set the run's status directly, bypassing the queue (after a failed write): False when even this
        is refused (a full disk), and the run stays "running" (reported incomplete)."""
        if status not in RUN_STATUSES or status == "running":
            raise ValueError(f"finish status must be one of complete/failed/incomplete/interrupted, not {status!r}")
        try:
            table = Run.__table__
            stmt = update(table).where(table.c.id == self._run(run_id)).values(status=status, finished_at=utcnow())
            with begin_write(self.ledger.engine) as conn:
                conn.execute(stmt)
        except Exception:  # noqa: BLE001 - the database refuses: nothing more can be recorded
            return False
        return True

    def flush(self) -> None:
        """Block until everything recorded so far is committed."""
        self._put(FLUSH)
        self._writer.join()
        self._check()

    def close(self) -> None:
        """Write everything still queued, stop the thread. The run's status is left as it is."""
        if self._closed:
            return
        with contextlib.suppress(LedgerError):
            self._handoff()
        self._closed = True
        atexit.unregister(self._close_at_exit)
        self._writer.stop()
        self._check()

    def _close_at_exit(self) -> None:
        with contextlib.suppress(LedgerError):
            self.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, run_id: int | None) -> int:
        rid = run_id if run_id is not None else self.run_id
        if rid is None:
            raise LedgerError("no run: call start_run() first or pass run_id")
        return rid

    def _check(self) -> None:
        self._writer.check()

    def _put(self, item: Message | FlushMessage) -> None:
        self._handoff()
        self._put_now(item)

    def _put_now(self, item: Message | FlushMessage) -> None:
        if self._closed:
            raise LedgerError("ledger writer is closed")
        self._check()
        self._writer.queue.put(item)


def delete_run(ledger: Ledger, run_id: int) -> None:
    """Delete a run and everything recorded for it, in one transaction."""
    with begin_write(ledger.engine) as conn:
        conn.execute(delete(EventRow.__table__).where(EventRow.__table__.c.run_id == run_id))
        conn.execute(delete(Run.__table__).where(Run.__table__.c.id == run_id))  # the rest cascades

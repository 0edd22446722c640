"""The background half of :class:`fallbackgate.ledger.writer.LedgerWriter`: one thread drains a queue into batches.

Each batch is written with bulk inserts in one transaction, every ``flush_interval_s`` or as soon as
``batch_size`` rows are pending. A lost connection is retried (see :class:`WriterThread`); any other failure
is kept and surfaced to the caller on its next call.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sqlalchemy import Table

from fallbackgate.engine.messages import RequestOutput, StepPlan, StepResult
from fallbackgate.ledger.audit_rows import diff_rows
from fallbackgate.ledger.backlog import DEFAULT_BUFFER_BYTES, Backlog, Batch, Op
from fallbackgate.ledger.bulk import insert_rows
from fallbackgate.ledger.db import Ledger, LedgerError, begin_write
from fallbackgate.ledger.models import (
    ArbitrationRow,
    Calibration,
    EventObjectsRow,
    EventRow,
    KVCopyRow,
    PositionDiffRow,
    QuarantineRow,
    Request,
    RequestStatRow,
    ServedLogitsRow,
    Step,
    StepRequest,
    VerdictRow,
    VerificationRow,
)
from fallbackgate.ledger.retry import DEFAULT_RETRY_S, is_transient, transaction_id, transaction_status
from fallbackgate.ledger.row_columns import TUPLE_COLUMNS
from fallbackgate.ledger.rows import Rows, request_row, step_rows

_TABLE_ORDER: tuple[Table, ...] = tuple(
    m.__table__  # type: ignore[misc]
    for m in (
        Step,
        StepRequest,
        ArbitrationRow,
        EventRow,
        EventObjectsRow,
        KVCopyRow,
        VerificationRow,
        Request,
        QuarantineRow,
        PositionDiffRow,
        RequestStatRow,
        ServedLogitsRow,
        VerdictRow,
        Calibration,
    )
)


@dataclasses.dataclass(slots=True)
class StepMessage:
    """One engine step and its events."""

    run_id: int  # the run the step belongs to
    plan: StepPlan  # what the scheduler planned
    result: StepResult  # what the engine did (events, timings)


@dataclasses.dataclass(slots=True)
class RequestMessage:
    """A finished request."""

    run_id: int  # the run the request belongs to
    output: RequestOutput  # the engine's output (tokens, timings, tag counts)
    slo: Mapping[str, Any] | None  # its class's SLO targets (None: no class declared)
    budget: Mapping[str, Any] | None  # its class's quality budget (None: no class declared)
    prompt: str | None  # the prompt text as received
    status: str = "finished"  # or "cancelled": the server shut down before it finished


@dataclasses.dataclass(slots=True)
class ForgetMessage:
    """No diffs will be recorded through this writer for the request: drop the steps it tracks for it."""

    run_id: int  # the run the request belongs to
    request_id: str  # the request


@dataclasses.dataclass(slots=True)
class DiffsMessage:
    """One request's per-position diffs against the exact baseline."""

    run_id: int  # the run the request belongs to
    request_id: str  # the audited request
    diffs: list[Any]  # one object with the ledger's diff fields per position
    stats: Any | None  # the request's summary statistics (None: none to record)
    step_ids: Sequence[int | None] | None  # each position's step (None: the request's sampling steps in order)


@dataclasses.dataclass(slots=True)
class RowsMessage:
    """Rows ready for one table."""

    table: Table  # where they go
    rows: list[dict[str, Any]]  # column -> value


@dataclasses.dataclass(slots=True)
class OpMessage:
    """A statement run in the batch's transaction after its inserts (updates, deletes)."""

    op: Op  # called with the batch's connection


@dataclasses.dataclass(slots=True)
class GroupMessage:
    """Messages handed over together (the caller's held steps)."""

    members: list[Message]  # the messages, in order


@dataclasses.dataclass(slots=True)
class FlushMessage:
    """Write what is pending, then mark the queue's items done (what :meth:`LedgerWriter.flush` waits on)."""


@dataclasses.dataclass(slots=True)
class StopMessage:
    """Write what is pending and end the thread."""


Message = StepMessage | RequestMessage | DiffsMessage | RowsMessage | OpMessage | GroupMessage | ForgetMessage
FLUSH = FlushMessage()


class WriterThread:
    """Turns queued messages into rows and writes them in batches on a daemon thread.

    A write that fails on a lost or refused connection (:func:`~fallbackgate.ledger.retry.is_transient`) is
    kept with everything queued after it in a :class:`~fallbackgate.ledger.backlog.Backlog` and retried, in
    order, with exponential backoff for up to ``retry_s``; a batch whose COMMIT was cut off is asked about
    (its transaction id) before it is written again, so nothing is written twice. Any other failure, or an
    outage past ``retry_s``, is kept and surfaced to the caller on its next call.
    """

    def __init__(
        self,
        ledger: Ledger,
        take_held: Callable[[], list[Message]],
        *,
        batch_size: int,
        flush_interval_s: float,
        max_queue: int,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        retry_s: float = DEFAULT_RETRY_S,
    ) -> None:
        self.ledger = ledger
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.take_held = take_held  # the caller's held steps, collected when the queue is quiet
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=max_queue)
        self.error: BaseException | None = None
        self.backlog = Backlog(buffer_bytes, retry_s)
        self._sample_steps: dict[tuple[int, str], list[int]] = {}
        self._thread = threading.Thread(target=self._loop, name="ledger-writer", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Raise :class:`LedgerError` if a write has failed."""
        if self.error is not None:
            err = self.error
            lines = str(getattr(err, "orig", None) or err).strip().splitlines() or [type(err).__name__]
            raise LedgerError(f"ledger writer failed: {lines[0]}") from err

    def join(self) -> None:
        """Block until every queued item has been written (or has failed); queue :data:`FLUSH` first."""
        self.queue.join()

    def stop(self) -> None:
        """Write what is queued and end the thread."""
        self.queue.put(StopMessage())
        self._thread.join()

    def _loop(self) -> None:
        stop = False
        while not stop or self.backlog:
            if self.backlog:
                stop = self._retry(stop)
                continue
            try:
                items: list[Any] = [self.queue.get(timeout=self.flush_interval_s)]
                num_queued = 1
            except queue.Empty:  # a quiet caller: write the steps it still holds, before anything it queues later
                held = self.take_held()
                if not held:
                    continue
                items, num_queued = [GroupMessage(held)], 0
            stop, batch = self._drain(items, num_queued)
            if self._attempt(batch):
                self._done(batch)
            else:
                self.backlog.keep(batch)

    def _retry(self, stop: bool) -> bool:
        """Wait out one backoff step (turning what arrives meanwhile into batches behind the backlog), then
        write the backlog in order until a write fails again. Returns whether a stop has been queued."""
        wait_s = self.backlog.backoff.failed()
        if wait_s == float("inf"):  # away too long: fail for good, release whoever waits on a flush
            self.error = self.error or LedgerError(
                f"ledger {self.ledger.display_url} unreachable for {self.backlog.backoff.retry_s:.0f} s "
                f"({self.backlog.last_error}); {self.backlog.num_bytes} bytes of rows not written"
            )
            while self.backlog:
                self._done(self.backlog.pop())
            self.backlog.backoff.succeeded()
            return stop
        deadline = time.monotonic() + wait_s
        while not stop and (remaining := deadline - time.monotonic()) > 0:
            try:
                items: list[Any] = [self.queue.get(timeout=remaining)]
                num_queued = 1
            except queue.Empty:
                held = self.take_held()
                if not held:
                    continue
                items, num_queued = [GroupMessage(held)], 0
            stop, batch = self._drain(items, num_queued)
            self.backlog.keep(batch)
        if stop:
            time.sleep(max(0.0, deadline - time.monotonic()))
        while self.backlog:
            if not self._attempt(self.backlog.batches[0]):
                return stop
            self._done(self.backlog.pop())
        self.backlog.backoff.succeeded()
        return stop

    def _done(self, batch: Batch) -> None:
        for _ in range(batch.num_queued):
            self.queue.task_done()

    def _drain(self, items: list[Any], num_queued: int) -> tuple[bool, Batch]:
        """Expand items (and whatever arrives within the flush interval) into one batch."""
        deadline = time.monotonic() + self.flush_interval_s
        rows: Rows = {}
        ops: list[Op] = []
        pending = 0
        stop = False
        while True:
            item = items[-1]
            if isinstance(item, FlushMessage | StopMessage):
                stop = isinstance(item, StopMessage)
                break
            try:
                pending += self._expand(item, rows, ops)
            except Exception as exc:  # noqa: BLE001 - surfaced to the caller on its next call
                self.error = self.error or exc
            if pending >= self.batch_size:
                break
            try:
                items.append(self.queue.get(timeout=max(0.0, deadline - time.monotonic())))
                num_queued += 1
            except queue.Empty:
                break
        return stop, Batch(rows, ops, num_queued)

    def _attempt(self, batch: Batch) -> bool:
        """Write ``batch`` in one transaction: True when it is written (or failed for good: the error is
        kept), False when the database was away and the batch must be tried again."""
        if not batch.rows and not batch.ops:
            return True
        engine = self.ledger.engine
        try:
            if batch.txn is not None:  # the last attempt was cut off: did its COMMIT land?
                status = transaction_status(engine, batch.txn)
                if status == "committed":
                    return True
                if status == "in progress":  # its lost session was just ended: ask again at the next try
                    return False
                batch.txn = None
            with begin_write(engine) as conn:
                batch.txn = transaction_id(conn)
                for table in _TABLE_ORDER:
                    insert_rows(conn, table, batch.rows.get(table, ()), TUPLE_COLUMNS.get(table, ()))
                for op in batch.ops:
                    op(conn)
        except Exception as exc:  # noqa: BLE001 - retried, or surfaced to the caller on its next call
            if is_transient(exc, engine.dialect.name):
                self.backlog.note_error(exc)
                return False
            self.error = self.error or exc
        return True

    def _expand(self, item: Message, rows: Rows, ops: list[Op]) -> int:
        """Turn one message into pending rows or statements; returns how many."""
        match item:
            case GroupMessage(members):
                return sum(self._expand(member, rows, ops) for member in members)
            case OpMessage(op):
                ops.append(op)
                return 1
            case RowsMessage(table, new):
                rows.setdefault(table, []).extend(new)
                return len(new)
            case StepMessage(run_id, plan, result):
                return step_rows(run_id, plan, result, rows, self._sample_steps)
            case RequestMessage(run_id, output, slo, budget, prompt, status):
                rows.setdefault(Request.__table__, []).append(request_row(run_id, output, slo, budget, prompt, status))
                return 1
            case ForgetMessage(run_id, request_id):
                self._sample_steps.pop((run_id, request_id), None)
                return 0
            case DiffsMessage(run_id, request_id, diffs, stats, step_ids):
                return diff_rows(run_id, request_id, diffs, stats, step_ids, rows, self._sample_steps)
        raise TypeError(f"not a ledger writer message: {item!r}")

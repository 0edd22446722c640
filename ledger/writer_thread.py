"""The background half of :class:`fallbackgate.ledger.writer.LedgerWriter`: one thread drains a queue into batches.

Each batch is written with bulk inserts in one transaction, every ``flush_interval_s`` or as soon as
``batch_size`` rows are pending. A failure is kept and surfaced to the caller on its next call.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, Table

from fallbackgate.engine.messages import RequestOutput, StepPlan, StepResult
from fallbackgate.ledger.audit_rows import diff_rows
from fallbackgate.ledger.bulk import insert_rows
from fallbackgate.ledger.db import Ledger, LedgerError, begin_write
from fallbackgate.ledger.models import (
    ArbitrationRow,
    Calibration,
    EventObjectsRow,
    EventRow,
    PositionDiffRow,
    Request,
    RequestStatRow,
    ServedLogitsRow,
    Step,
    StepRequest,
    VerdictRow,
    VerificationRow,
)
from fallbackgate.ledger.rows import TUPLE_COLUMNS, Rows, request_row, step_rows

_TABLE_ORDER: tuple[Table, ...] = tuple(
    m.__table__  # type: ignore[misc]
    for m in (
        Step,
        StepRequest,
        ArbitrationRow,
        EventRow,
        EventObjectsRow,
        VerificationRow,
        Request,
        PositionDiffRow,
        RequestStatRow,
        ServedLogitsRow,
        VerdictRow,
        Calibration,
    )
)
Op = Callable[[Connection], None]


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
    """Turns queued messages into rows and writes them in batches on a daemon thread."""

    def __init__(
        self,
        ledger: Ledger,
        take_held: Callable[[], list[Message]],
        *,
        batch_size: int,
        flush_interval_s: float,
        max_queue: int,
    ) -> None:
        self.ledger = ledger
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.take_held = take_held  # the caller's held steps, collected when the queue is quiet
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=max_queue)
        self.error: BaseException | None = None
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
        while not stop:
            try:
                items: list[Any] = [self.queue.get(timeout=self.flush_interval_s)]
                num_queued = 1
            except queue.Empty:  # a quiet caller: write the steps it still holds, before anything it queues later
                held = self.take_held()
                if not held:
                    continue
                items, num_queued = [GroupMessage(held)], 0
            stop, num_queued = self._drain(items, num_queued)
            for _ in range(num_queued):
                self.queue.task_done()

    def _drain(self, items: list[Any], num_queued: int) -> tuple[bool, int]:
        """Expand items (and whatever arrives within the flush interval) into one batch and write it."""
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
        self._write(rows, ops)
        return stop, num_queued

    def _write(self, rows: Rows, ops: list[Op]) -> None:
        if not rows and not ops:
            return
        try:
            with begin_write(self.ledger.engine) as conn:
                for table in _TABLE_ORDER:
                    insert_rows(conn, table, rows.get(table, ()), TUPLE_COLUMNS.get(table, ()))
                for op in ops:
                    op(conn)
        except Exception as exc:  # noqa: BLE001 - surfaced to the caller on its next call
            if self.error is None:
                self.error = exc

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

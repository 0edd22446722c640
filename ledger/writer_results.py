"""What a :class:`~fallbackgate.ledger.writer.LedgerWriter` records besides steps and requests: the audit's diffs,
verdicts and replays, weight verifications, quarantines, arbitrations, the audit work left to workers, and the
run's numeric floor, memory account and cost calibrations. Every record is queued like a step's rows."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sqlalchemy import update

from fallbackgate.engine.messages import RequestOutput
from fallbackgate.engine.tags import Tag
from fallbackgate.ledger.arbitration_queries import fill_audited_costs
from fallbackgate.ledger.audit_queue import add_tasks, served_rows
from fallbackgate.ledger.audit_rows import verdict_row
from fallbackgate.ledger.models import (
    ArbitrationRow,
    Calibration,
    QuarantineRow,
    Request,
    RequestStatRow,
    Run,
    ServedLogitsRow,
    VerdictRow,
    VerificationRow,
    utcnow,
)
from fallbackgate.ledger.rows import value, verification_rows
from fallbackgate.ledger.writer_thread import DiffsMessage, Message, Op, OpMessage, RowsMessage


def run_update(run_id: int, **values: Any) -> Op:
    """An operation that sets ``values`` on the run's row."""
    stmt = update(Run.__table__).where(Run.__table__.c.id == run_id).values(**values)
    return lambda conn: conn.execute(stmt)


class ResultRecording:
    """The audit's and the run's results half of :class:`~fallbackgate.ledger.writer.LedgerWriter`."""

    _run: Callable[[int | None], int]  # LedgerWriter._run(run_id): the given run, else the current one
    _put: Callable[[Message], None]  # LedgerWriter._put(message): queue it behind the held steps

    def record_arbitrations(self, rows: Sequence[Mapping[str, Any]], *, run_id: int | None = None) -> None:
        """Record a step's arbitrations: rows with the ``arbitrations`` columns but ``run_id`` and ``id``
        (see :func:`fallbackgate.recording.arbitrations.arbitration_rows`)."""
        rid = self._run(run_id)
        if rows:
            self._put(RowsMessage(ArbitrationRow.__table__, [{**row, "run_id": rid} for row in rows]))

    def fill_arbitration_costs(self, *, run_id: int | None = None) -> None:
        """After the audit's diffs: each arbitration's audited cost, from the position its step sampled."""
        rid = self._run(run_id)
        self._put(OpMessage(lambda conn: fill_audited_costs(conn, rid)))

    def record_diffs(
        self,
        request_id: str,
        diffs: Sequence[Any],
        stats: Any | None = None,
        *,
        step_ids: Sequence[int | None] | None = None,
        run_id: int | None = None,
    ) -> None:
        """Record per-position diffs (objects with :data:`DIFF_FIELDS`) and optional summary stats.

        ``diffs[i].position`` is the index of the output token. When ``step_ids`` is None, each
        position's step is the i-th recorded step that sampled a token for this request.
        """
        self._put(DiffsMessage(self._run(run_id), request_id, list(diffs), stats, step_ids))

    def record_verdict(
        self,
        request_id: str | None,
        passed: bool,
        reason: str = "",
        *,
        run_id: int | None = None,
        **located: Any,
    ) -> None:
        """Record a gate verdict for a request (or the run when ``request_id`` is None); ``located`` are the
        keywords of :func:`~fallbackgate.ledger.audit_rows.verdict_row` (position, step, layer, tags, and
        the two halves: quality_passed, correctness_passed)."""
        row = verdict_row(self._run(run_id), request_id, passed, reason, **located)
        self._put(RowsMessage(VerdictRow.__table__, [row]))
        if request_id is not None:
            tbl = Request.__table__
            stmt = (
                update(tbl)
                .where(tbl.c.run_id == row["run_id"], tbl.c.request_id == request_id)
                .values(verdict="pass" if passed else "fail")
            )
            self._put(OpMessage(lambda conn: conn.execute(stmt)))

    def record_quarantines(self, rows: list[Mapping[str, Any]], *, run_id: int | None = None) -> None:
        """Record quarantined objects and the requests they touched (``quarantines`` columns but run_id)."""
        run = self._run(run_id)
        if rows:
            self._put(RowsMessage(QuarantineRow.__table__, [dict(row, run_id=run) for row in rows]))

    def record_replay(self, request_id: str, stats: Mapping[str, Any], *, run_id: int | None = None) -> None:
        """Record a request's served-vs-replay statistics (``replay_*`` columns of its request_stats row,
        which :meth:`record_diffs` must have queued before)."""
        tbl = RequestStatRow.__table__
        rid = self._run(run_id)
        values = {f"replay_{k}": v for k, v in stats.items()}
        stmt = update(tbl).where(tbl.c.run_id == rid, tbl.c.request_id == request_id).values(**values)
        self._put(OpMessage(lambda conn: conn.execute(stmt)))

    def record_verifications(self, verifications: Sequence[Any], *, run_id: int | None = None) -> None:
        """Record weight copies checked against the checkpoint outside a step (dense weights at audit)."""
        self._put(RowsMessage(VerificationRow.__table__, verification_rows(self._run(run_id), verifications)))

    def queue_audits(
        self, outputs: Sequence[RequestOutput], *, with_run_task: bool = True, run_id: int | None = None
    ) -> None:
        """Leave these requests to audit workers: their served logits, one task each and, unless the run
        goes on serving (a server adds it when it stops), the run's task."""
        rid = self._run(run_id)
        for output in outputs:
            self._put(RowsMessage(ServedLogitsRow.__table__, served_rows(rid, output.request_id, output.output_logits)))
        request_ids = [o.request_id for o in outputs]
        self._put(OpMessage(lambda conn: add_tasks(conn, rid, request_ids, with_run_task)))

    def record_control(
        self, numeric_floor_kl: float, *, floor: dict[str, Any] | None = None, run_id: int | None = None
    ) -> None:
        """Record the run's numeric floor: the max KL of the exact-vs-exact control, and optionally all of
        the control's statistics (``audit.auditor.floor_control``: KL, logit noise, top-1, dtype)."""
        values: dict[str, Any] = {"numeric_floor_kl": float(numeric_floor_kl)}
        if floor is not None:
            values["numeric_floor"] = dict(floor)
        self._put(OpMessage(run_update(self._run(run_id), **values)))

    def record_memory(self, memory: dict[str, Any], *, run_id: int | None = None) -> None:
        """Record the run's memory account: budgets, peak device-pool bytes (total and by kind), peak
        host-tier bytes and the dense bytes outside the budget (``serving.session.memory_summary``)."""
        self._put(OpMessage(run_update(self._run(run_id), memory=dict(memory))))

    def record_calibration(
        self,
        tag: Tag | str,
        layer: int,
        scale: float,
        num_samples: int,
        run_ids: Sequence[int],
    ) -> None:
        """Record a fitted cost-predictor scale for one tag and layer."""
        row = {
            "tag": value(tag),
            "layer": layer,
            "scale": scale,
            "num_samples": num_samples,
            "run_ids": list(run_ids),
            "fitted_at": utcnow(),
        }
        self._put(RowsMessage(Calibration.__table__, [row]))

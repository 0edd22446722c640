"""An audit worker: claims deferred audit tasks from a ledger and does them (see ``ledger.audit_queue``).

A request task runs both baselines against the served logits the serving process left in the ledger and
writes the request's diffs; the run task (claimable once every request task of the run is done) runs the
floor control, replays the exact- or equivalent-only requests that fail against the baseline (``run_audit``),
judges the run and writes its verdicts. Results are written only while the worker's claim
is current; a heartbeat thread renews the lease while a task runs. The model is loaded once per (model,
dtype, block size) with no expert in memory: the baselines read experts from the checkpoint files.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import Connection, bindparam, update

from fallbackgate.audit.auditor import audit_request
from fallbackgate.audit.gate import evaluate_run, fails_against_baseline, served_exactness
from fallbackgate.audit.run_audit import initial_floor, replay_to_explain, widen_floor
from fallbackgate.audit.tolerances import Floor
from fallbackgate.audit.verdicts import write_verdicts
from fallbackgate.engine.baseline.api import BaselineEngine, build_baseline_engine
from fallbackgate.engine.experts.quarantine import ExpertQuarantined
from fallbackgate.engine.tags import Exactness
from fallbackgate.ledger import audit_queries, audit_queue, queries
from fallbackgate.ledger.audit_queue import Claim, LeaseLost
from fallbackgate.ledger.audit_rows import diff_rows
from fallbackgate.ledger.bulk import insert_rows
from fallbackgate.ledger.db import Ledger, begin_write
from fallbackgate.ledger.models import PositionDiffRow, QuarantineRow, RequestStatRow, Run, VerificationRow
from fallbackgate.ledger.quarantine_rows import object_rows, request_row
from fallbackgate.ledger.retry import DEFAULT_RETRY_S, Backoff, is_transient
from fallbackgate.ledger.rows import Rows, verification_rows

POLL_S = 0.5  # wait between claims while other workers hold the remaining tasks
REPLAY_KEPT = ("max_kl", "mean_kl", "max_position", "top1_agreement", "error", "routing_swaps")  # replay_* columns
T = TypeVar("T")


def worker_name() -> str:
    """host:pid, recorded on every task this process claims."""
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclasses.dataclass(slots=True)
class WorkerStats:
    """What one worker did."""

    num_requests: int = 0  # request tasks completed
    num_runs: int = 0  # runs judged
    num_lost: int = 0  # tasks whose lease another worker took over before this one finished
    num_reconnects: int = 0  # ledger calls retried after a lost or refused connection


class _Heartbeat:
    """Renews a claim's lease every third of it until stopped; remembers a lost lease."""

    def __init__(self, ledger: Ledger, held: Claim, lease_s: float) -> None:
        self.ledger, self.held, self.lease_s = ledger, held, lease_s
        self.stop = threading.Event()
        self.lost: LeaseLost | None = None
        self.thread = threading.Thread(target=self._loop, name="audit-lease", daemon=True)

    def _loop(self) -> None:
        while not self.stop.wait(self.lease_s / 3):
            try:
                audit_queue.renew(self.ledger, self.held, self.lease_s)
            except LeaseLost as exc:
                self.lost = exc
                return
            except Exception as exc:  # a ledger away: renew at the next beat (the lease may outlast it)
                if not is_transient(exc, self.ledger.engine.dialect.name):
                    raise

    def __enter__(self) -> _Heartbeat:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


class AuditWorker:
    """Claims and does audit tasks until none is left (or `max_tasks` are done)."""

    def __init__(
        self, ledger: Ledger, lease_s: float = 60.0, run_id: int | None = None, retry_s: float = DEFAULT_RETRY_S
    ) -> None:
        self.ledger, self.lease_s, self.run_id = ledger, lease_s, run_id
        self.retry_s = retry_s  # how long the ledger may stay away before the worker gives up
        self.name = worker_name()
        self.engines: dict[tuple[str, str | None, int], BaselineEngine] = {}
        self.stats = WorkerStats()

    def run(self, max_tasks: int | None = None, follow: bool = False) -> WorkerStats:
        """Work until every task (of the run, when one was named) is done; with `follow`, also until the
        named run has finished serving (a server keeps adding tasks). A ledger that goes away is waited for
        (reconnecting with backoff, for up to `retry_s`); a task cut off by it is done again under the same
        claim, whose fencing token keeps its result from being written twice."""
        num_done = 0
        while max_tasks is None or num_done < max_tasks:
            held = self._retrying(lambda: audit_queue.claim(self.ledger, self.name, self.lease_s, self.run_id))
            if held is None:
                counts = self._retrying(lambda: audit_queue.task_counts(self.ledger, self.run_id))
                is_serving = follow and self._retrying(self._is_serving)
                if not counts.get("pending") and not counts.get("claimed") and not is_serving:
                    break
                time.sleep(POLL_S)  # the rest is held by others (or waits for their leases to expire)
                continue
            try:
                with _Heartbeat(self.ledger, held, self.lease_s):
                    self._retrying(lambda: self.do(held))  # noqa: B023 - called at once, in this iteration
            except LeaseLost:
                self.stats.num_lost += 1
            num_done += 1
        return self.stats

    def _retrying(self, call: Callable[[], T]) -> T:
        """``call()``, again after each lost or refused connection, with backoff, until `retry_s` passes."""
        backoff = Backoff(self.retry_s)
        while True:
            try:
                result = call()
            except Exception as exc:
                if not is_transient(exc, self.ledger.engine.dialect.name):
                    raise
                wait_s = backoff.failed()
                if wait_s == float("inf"):
                    raise
                self.stats.num_reconnects += 1
                time.sleep(wait_s)
                continue
            return result

    def _is_serving(self) -> bool:
        run = queries.get_run(self.ledger, self.run_id) if self.run_id is not None else None
        return run is not None and run["status"] == "incomplete" and run.get("finished_at") is None

    def do(self, held: Claim) -> None:
        """Do one claimed task."""
        engine = self.engine_for(held.run_id)
        if held.request_id == audit_queue.RUN_TASK:
            self._judge_run(engine, held)
            self.stats.num_runs += 1
        else:
            self._audit_request(engine, held)
            self.stats.num_requests += 1

    def engine_for(self, run_id: int) -> BaselineEngine:
        """The audit engine for a run's model, dtype and block size (experts stay in the files)."""
        run = queries.get_run(self.ledger, run_id)
        memory = (run or {}).get("memory") or {}
        key = (str(run["model_path"]), memory.get("dtype"), int(memory.get("block_size", 16)))
        if key not in self.engines:
            self.engines[key] = build_baseline_engine(key[0], key[1], key[2])
        return self.engines[key]

    def _audit_request(self, engine: BaselineEngine, held: Claim) -> None:
        run_id, request_id = held.run_id, held.request_id
        found = audit_queries.request_tokens(self.ledger, run_id, request_id)
        if found is None:
            raise LookupError(f"run {run_id}: request {request_id} has no token ids recorded")
        token_ids, num_prompt = found
        served_rows = audit_queue.read_served(self.ledger, run_id, request_id)
        served = served_exactness(queries.request_exactness(self.ledger, run_id).get(request_id, {}))
        is_approximate = served is Exactness.APPROXIMATE
        prompt_ids, output_ids = token_ids[:num_prompt], token_ids[num_prompt:]
        try:
            diffs, stats, replay = audit_request(
                engine, self.ledger, run_id, request_id, prompt_ids, output_ids, served_rows, is_approximate
            )
        except ExpertQuarantined as exc:  # its baseline needs bytes the checkpoint no longer gives: unauditable
            rows_of = [*object_rows([exc.record]), request_row(request_id, str(exc), "unaudited")]
            quarantined = {QuarantineRow.__table__: [dict(r, run_id=run_id) for r in rows_of]}
            audit_queue.complete(self.ledger, held, lambda conn: _insert(conn, quarantined))
            return
        steps = audit_queries.step_requests(self.ledger, run_id, request_id)
        step_ids = [r["step_id"] for r in steps if r["is_sampled"]]
        rows: Rows = {}
        diff_rows(run_id, request_id, diffs, stats, step_ids if len(step_ids) == len(diffs) else None, rows, {})
        if replay is not None:
            rows[RequestStatRow.__table__][0].update({f"replay_{k}": v for k, v in replay.items() if k in REPLAY_KEPT})
        failed = engine.verify_audit_copies()  # the baselines' own expert copies, checked again
        if failed:
            rows[VerificationRow.__table__] = verification_rows(run_id, failed)
        audit_queue.complete(self.ledger, held, lambda conn: _insert(conn, rows))

    def _judge_run(self, engine: BaselineEngine, held: Claim) -> None:
        run_id = held.run_id
        summaries = [r for r in queries.request_summaries(self.ledger, run_id) if r["num_positions"] is not None]
        requests = []
        for r in summaries:
            token_ids, num_prompt = audit_queries.request_tokens(self.ledger, run_id, r["request_id"]) or ([], 0)
            requests.append((r["request_id"], token_ids[:num_prompt], token_ids[num_prompt:]))
        control = initial_floor(engine, requests)
        by_exactness = queries.request_exactness(self.ledger, run_id)
        served_of = {r["request_id"]: served_exactness(by_exactness.get(r["request_id"], {})) for r in summaries}
        for request, summary in zip(requests, summaries, strict=True):
            widen_floor(engine, control, request, served_of[request[0]], summary["max_kl"])
        floor = control.summary()
        replays = self._replays_to_explain(engine, run_id, summaries, served_of, Floor.of_run({"numeric_floor": floor}))
        with begin_write(self.ledger.engine) as conn:  # the floor, under the claim (a taken-over run redoes it)
            audit_queue.check_held(conn, held)
            values = {"numeric_floor_kl": floor["max_kl"], "numeric_floor": floor}
            conn.execute(update(Run).where(Run.id == run_id).values(**values))
            for request_id, (kls, replay) in replays.items():
                _write_replay(conn, run_id, request_id, kls, replay)
            failed = engine.verify_audit_copies()
            if failed:
                insert_rows(conn, VerificationRow.__table__, verification_rows(run_id, failed), ())
        verdict = evaluate_run(self.ledger, run_id)
        audit_queue.complete(self.ledger, held, lambda conn: write_verdicts(conn, verdict))

    def _replays_to_explain(
        self,
        engine: BaselineEngine,
        run_id: int,
        summaries: list[dict[str, Any]],
        served_of: dict[str, Exactness],
        floor: Floor,
    ) -> dict[str, tuple[list[float], dict[str, Any]]]:
        """request id -> per-position replay KL and summary, for the requests not replayed yet that
        :func:`~fallbackgate.audit.run_audit.replay_to_explain` replays under the run's final floor."""
        out = {}
        for summary in summaries:
            request_id = summary["request_id"]
            if summary["replay_max_kl"] is not None or served_of[request_id] is Exactness.APPROXIMATE:
                continue
            if not fails_against_baseline(summary, summary["budget"], served_of[request_id], floor):
                continue  # passes even on raw top-1 (never above the near-tie-discounted one): no rows to read
            kls, replay = replay_to_explain(
                engine, self.ledger, run_id, request_id, audit_queue.read_served(self.ledger, run_id, request_id),
                queries.position_diffs(self.ledger, run_id, request_id), summary["budget"], served_of[request_id],
                summary, floor,
            )  # fmt: skip
            if replay is not None:
                out[request_id] = (kls or [], replay)
        return out


def _write_replay(conn: Connection, run_id: int, request_id: str, kls: list[float], replay: dict[str, Any]) -> None:
    """A replay done at judging: its request_stats ``replay_*`` columns and each position's ``replay_kl``."""
    stats = RequestStatRow.__table__
    values = {f"replay_{k}": v for k, v in replay.items() if k in REPLAY_KEPT}
    conn.execute(update(stats).where(stats.c.run_id == run_id, stats.c.request_id == request_id).values(**values))
    if kls:
        diffs = PositionDiffRow.__table__
        at = (diffs.c.run_id == run_id, diffs.c.request_id == request_id, diffs.c.position == bindparam("b_position"))
        stmt = update(diffs).where(*at).values(replay_kl=bindparam("b_replay_kl"))
        conn.execute(stmt, [{"b_position": position, "b_replay_kl": kl} for position, kl in enumerate(kls)])


def _insert(conn: Connection, rows: Rows) -> None:
    for table, table_rows in rows.items():
        insert_rows(conn, table, table_rows, ())


def audit_loop(
    url: str, lease_s: float, run_id: int | None, max_tasks: int | None, follow: bool = False
) -> dict[str, Any]:
    """Open the ledger at `url` and work (what one ``fallbackgate audit`` process does)."""
    from fallbackgate.ledger.db import open_ledger

    with open_ledger(url) as ledger:
        stats = AuditWorker(ledger, lease_s, run_id).run(max_tasks, follow)
    return dataclasses.asdict(stats)

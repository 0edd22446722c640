"""One ledger run, recorded the one way: the run row, every step, every finished request, and a close that
audits inline (judging the run) or leaves the audits to ``fallbackgate audit`` workers.

Batch runs (``fallbackgate run``, the sweep, :func:`fallbackgate.recording.record_and_judge`) serve with
:meth:`RunRecorder.serve` and close with :meth:`RunRecorder.finish`; streaming runs (the HTTP server,
lm-eval) record each request as it finishes with :meth:`RunRecorder.on_request`, audit it
(:meth:`RunRecorder.defer_audits`, :meth:`RunRecorder.record_audit`) and close with :meth:`RunRecorder.close`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

import torch
import transformers

from fallbackgate.audit.auditor import audited_ids, choose_audited
from fallbackgate.audit.gate import RunVerdict, evaluate_run
from fallbackgate.audit.run_audit import audit_outputs
from fallbackgate.audit.stats import PositionDiff, RequestDiffStats
from fallbackgate.audit.verdicts import record_verdicts
from fallbackgate.batch.prompts import PromptSpec
from fallbackgate.batch.session import RunOutcome, RunSettings, run_prompts
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.hardware import profile_record
from fallbackgate.engine.messages import RequestOutput, StepPlan, StepResult
from fallbackgate.ledger import audit_queries
from fallbackgate.ledger.db import LedgerError
from fallbackgate.ledger.quarantine_rows import object_rows, request_row, step_rows
from fallbackgate.ledger.writer import LedgerWriter
from fallbackgate.policy.schema import AuditMode
from fallbackgate.recording.arbitrations import arbitration_rows

if TYPE_CHECKING:  # the tracer (and pyarrow) load only for runs that write a trace
    from fallbackgate.tracing.live import LiveTracer


@dataclasses.dataclass(kw_only=True, slots=True)
class RequestClasses:
    """The request classes a run records on each request row and the gate judges with."""

    budgets: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # class -> quality budget
    slos: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # class -> SLO targets (ms)
    default: str = "default"  # the class of a request that names none


@dataclasses.dataclass(kw_only=True, slots=True)
class RunRow:
    """What the run row says about how the run was assembled (mode and forced tags come from the engine)."""

    controller: str  # controller kind
    note: str = ""  # free text: the command, a sweep cell
    policy: str | None = None  # the effective policy as JSON; None: no policy file
    policy_name: str | None = None  # the policy file's stem; None: no policy file


def versions() -> dict[str, str]:
    """Versions of fallbackgate, torch and transformers, for the run row."""
    try:
        own = version("fallbackgate")
    except PackageNotFoundError:
        own = "source"
    return {"fallbackgate": own, "torch": torch.__version__, "transformers": transformers.__version__}


class RunRecorder:
    """Writes one engine's run to a ledger through ``writer`` (see the module docstring).

    Construction inserts the run row (status "running"); ``audit_rate`` and ``seed`` choose a batch run's
    audited sample, to which every request with a non-resident KV event is added (audit by risk).
    Every close leaves the writer closed.
    """

    def __init__(
        self,
        writer: LedgerWriter,
        engine: Engine,
        row: RunRow,
        classes: RequestClasses | None = None,
        *,
        audit_rate: float = 1.0,
        seed: int = 0,
        tracer: LiveTracer | None = None,
    ) -> None:
        self.writer, self.engine = writer, engine
        self.tracer = tracer  # writes the run's trace (run/serve --trace DIR); closed with the run
        self.classes = classes or RequestClasses()
        self.audit_rate, self.seed = audit_rate, seed
        self.num_audited = 0  # requests audited inline and recorded
        self.num_deferred = 0  # requests left to audit workers
        self.audited_stats: list[RequestDiffStats] = []  # summaries of the inline audits, in order
        self._num_quarantined = 0  # quarantine records already written
        self._deferred_seen: set[tuple[str, str]] = set()  # (request, expert) deferral rows already written
        self.run_id = writer.start_run(
            policy=row.policy,
            policy_name=row.policy_name,
            model_path=engine.config.model_dir,
            controller=row.controller,
            hardware_profile=profile_record(engine.config.profile),
            versions=versions(),
            mode=(AuditMode.OBSERVE if engine.is_observe else AuditMode.ENFORCE).value,
            note=row.note,
            forced_tags=sorted(getattr(t, "value", str(t)) for t in getattr(engine.controller, "force", ())),
            trace_path=tracer.directory if tracer is not None else None,
        )

    # --- while serving --------------------------------------------------------------------------
    def on_step(self, plan: StepPlan, result: StepResult) -> None:
        """Record one engine step, its events and its controller's arbitrations (with measured arrival)."""
        self.writer.record_step(plan, result)
        self.record_faults(result)
        take = getattr(self.engine.controller, "take_arbitrations", None)
        decided = take() if take is not None else []
        if decided:
            self.writer.record_arbitrations(arbitration_rows(decided, result))
        if self.tracer is not None:
            self.tracer.on_step(plan, result, decided)

    def record_faults(self, result: StepResult | None = None) -> None:
        """Record experts quarantined since the last call and the requests the step failed or deferred."""
        records = self.engine.expert_store.reader.quarantine.records()
        rows = object_rows(records[self._num_quarantined :])
        self._num_quarantined = len(records)
        if result is not None:
            rows += step_rows(result, self._deferred_seen)
        self.writer.record_quarantines(rows)

    def record_unaudited(self, unaudited: dict[str, str]) -> None:
        """Record requests whose audit needed a quarantined object (request id -> the quarantine)."""
        self.record_faults()
        self.writer.record_quarantines([request_row(rid, why, "unaudited") for rid, why in unaudited.items()])

    def on_request(self, output: RequestOutput, prompt: str | None = None, status: str = "finished") -> None:
        """Record a request that ended with ``status`` ("finished"; "cancelled": what it had produced when the
        server shut down) with its class's SLO and quality budget."""
        name = output.request_class
        budget, slo = self.classes.budgets.get(name), self.classes.slos.get(name)
        self.writer.record_request(output, prompt=prompt, budget=budget, slo=slo, status=status)
        if self.tracer is not None:
            self.tracer.on_request(output, slo)

    def serve(self, specs: list[PromptSpec], settings: RunSettings, progress: bool = False) -> RunOutcome:
        """Serve ``specs`` on the engine recording every step; a run that raises is marked failed first. Only
        the requests :meth:`finish` will audit keep their full logits."""
        kept = audited_ids([s.request_id for s in specs], self.audit_rate, self.seed)
        with self._failing():
            return run_prompts(self.engine, specs, settings, self.on_step, progress, logits_kept_ids=kept)

    def defer_audits(self, outputs: Sequence[RequestOutput]) -> None:
        """Leave these requests' audits to workers: their served logits (copied out: the caller may drop them)
        and a task each in the ledger."""
        self.writer.queue_audits(outputs, with_run_task=False)
        self.num_deferred += len(outputs)

    def forget(self, request_id: str) -> None:
        """Nothing more will be recorded for this request through this recorder (its audit, if any, is a
        worker's): the writer releases what it tracks for it."""
        self.writer.forget_request(request_id)

    def record_audit(
        self,
        request_id: str,
        diffs: Sequence[PositionDiff],
        stats: RequestDiffStats,
        step_ids: Sequence[int | None] | None = None,
    ) -> None:
        """Record one request's audit (its diffs against the exact baseline and their summary)."""
        self.writer.record_diffs(request_id, diffs, stats, step_ids=step_ids)
        self.audited_stats.append(stats)
        self.num_audited += 1

    def record_floor(self, floor: dict[str, Any]) -> None:
        """Record the run's numeric floor (``floor["max_kl"]``: exact against exact)."""
        self.writer.record_control(floor["max_kl"], floor=floor)

    # --- closing --------------------------------------------------------------------------------
    def finish(self, outcome: RunOutcome, *, is_deferred: bool = False) -> RunVerdict | None:
        """Close a batch run: record every request, audit the seeded sample inline (replaying recorded
        actions; the numeric floor first) or leave it to workers, finish the run and judge it. Returns the
        verdict (None when deferred)."""
        with self._failing():
            for spec, output in zip(outcome.specs, outcome.outputs, strict=True):
                self.on_request(output, spec.prompt, "failed" if output.request_id in outcome.failures else "finished")
            self._close_trace()  # the trace is of serving: the audit's own checkpoint reads are not the run's I/O
            audited = self._choose_audited([o for o in outcome.outputs if o.request_id not in outcome.failures])
            self.writer.record_verifications(self.engine.verify_dense())  # the baselines compute with these
            if is_deferred:
                self.defer_audits(audited)
            else:
                self._audit_inline(audited)
            for output in audited:  # stored or audited: the full logits are not needed any more
                output.output_logits = None
        return self.close(memory=outcome.memory)

    def close(self, status: str = "complete", *, memory: dict[str, Any] | None = None) -> RunVerdict | None:
        """Finish the run with ``status`` (queuing the run's audit task when audits were deferred), judge it
        when its audits ran inline and it completed, record the verdicts and close the writer."""
        with self._failing():
            self._close_trace()
            if self.num_deferred:
                self.writer.queue_audits([], with_run_task=True)
            if memory is not None:
                self.writer.record_memory(memory)
            self.writer.finish_run(status=status)
        verdict = None
        try:
            if status == "complete" and self.num_audited and not self.num_deferred:
                verdict = evaluate_run(self.writer.ledger, self.run_id)
                record_verdicts(self.writer, verdict)
        finally:
            self.writer.close()
        return verdict

    def fail(self, status: str = "failed") -> None:
        """Mark the run ``status`` and close the writer, as far as the database still allows (a full disk
        may refuse even that: the run then stays "running", which queries report as incomplete, never PASS).
        A trace being written is closed too (what it holds so far stays readable)."""
        try:
            with contextlib.suppress(Exception):  # the run is failing already: its status matters more
                self._close_trace()
            self.writer.finish_run(status=status)
        except LedgerError:  # the queue holds a failed write: try the status alone, directly
            self.writer.mark_run_now(status)
        finally:
            try:
                self.writer.close()
            except LedgerError:
                pass

    def _close_trace(self) -> None:
        if self.tracer is not None:
            self.tracer.close()

    def _choose_audited(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """The seeded sample, and by risk every request with a non-resident KV event, in output order."""
        if self.audit_rate >= 1.0:
            return list(outputs)
        self.writer.flush()  # the events say which requests read KV off device
        risky = audit_queries.requests_with_kv_events(self.writer.ledger, self.run_id)
        chosen = {o.request_id for o in choose_audited(outputs, self.audit_rate, self.seed)} | risky
        return [o for o in outputs if o.request_id in chosen]

    def _audit_inline(self, audited: list[RequestOutput]) -> None:
        self.writer.flush()  # the replay reads each request's trace back from the ledger
        results, floor, unaudited = audit_outputs(self.engine, self.writer.ledger, self.run_id, audited)
        self.record_unaudited(unaudited)
        for result in results:
            self.record_audit(result.request_id, result.diffs, result.stats)
            if result.replay is not None:
                self.writer.record_replay(result.request_id, result.replay)
        self.writer.record_verifications(self.engine.verify_audit_copies())  # the baselines' own expert copies
        self.record_floor(floor)

    @contextlib.contextmanager
    def _failing(self) -> Iterator[None]:
        """An exception inside marks the run failed (interrupted for Ctrl-C) and propagates."""
        try:
            yield
        except BaseException as exc:
            self.fail("interrupted" if isinstance(exc, KeyboardInterrupt) else "failed")
            raise

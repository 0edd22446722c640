"""One engine loop serving many HTTP requests: continuous batching, recording, deferred audits.

HTTP handlers submit requests from the event loop; a single thread owns the engine: it admits new
requests between steps (so concurrent requests share every forward), records each step and finished
request to the ledger (one run per server start), leaves a sampled request's audit to the background
audit worker (served logits and a task in the ledger, never an audit on the serving path) and hands
sampled tokens back to each handler's asyncio queue. Draining stops admissions, lets in-flight requests
finish for a grace period, then ends the rest as interrupted (recorded as cancelled requests: what they
had produced) and marks the run incomplete. Admission is bounded: beyond ``max_num_seqs`` running and
``max_queued`` waiting requests a submission is refused (Overloaded) rather than queued, and so is every new one
while the ledger is away and the records waiting for it reach the writer's buffer bound (requests already admitted
run on: nothing is served unrecorded).

Between steps the loop also ends requests early, each leaving the engine with its KV freed: at the first
occurrence of one of its stop strings (recorded as finished, its text cut before the stop), past its
deadline (recorded as cancelled, the handler told "timeout") and when its handler cancels it because the
client went away (recorded as cancelled).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Mapping
from typing import Any

from fallbackgate.api_server.metrics import ServerMetrics
from fallbackgate.api_server.submissions import Done, Failed, Overloaded, Reply, Submission, Token, Unavailable
from fallbackgate.audit.auditor import AuditSampler
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.errors import EngineError
from fallbackgate.engine.messages import RequestOutput
from fallbackgate.recording import RunRecorder

LEDGER_RETRY_AFTER_S = 5  # Retry-After of a request refused while the ledger's buffer is full


class EngineService:
    """Owns the engine and its loop thread (see the module docstring)."""

    def __init__(
        self,
        engine: Engine,
        recorder: RunRecorder | None,
        metrics: ServerMetrics,
        *,
        classes: Collection[str],
        slos: Mapping[str, Mapping[str, Any]],
        audit_rate: float,
        seed: int = 0,
        max_queued: int = 128,
    ) -> None:
        self.engine, self.recorder, self.metrics = engine, recorder, metrics
        self.classes, self.slos = frozenset(classes), slos  # the class names requests may name; class -> SLO
        self.sampler = AuditSampler(audit_rate, seed)
        self._inbox: list[Submission] = []
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._pending: dict[str, Submission] = {}
        self._cancels: dict[str, str] = {}  # request id -> why its handler cancelled it (taken between steps)
        self.max_queued = max_queued  # requests waiting for a decode slot at most (beyond them: Overloaded)
        self._num_open = 0  # submitted and not yet answered (running, waiting, or in the inbox)
        self.num_cancelled = 0  # requests still running at shutdown, recorded as cancelled
        self._is_draining = False
        self._deadline: float | None = None
        self.num_interrupted = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fallbackgate-engine", daemon=True)

    @property
    def is_alive(self) -> bool:
        """True while the loop thread runs and has not failed."""
        return self._thread.is_alive() and self.error is None

    def start(self) -> None:
        self._thread.start()

    def submit(self, *submissions: Submission) -> None:
        """Queue requests for the loop, all or none (Unavailable while draining or after a failure; Overloaded
        when `max_queued` requests already wait beyond the engine's `max_num_seqs` running ones)."""
        with self._lock:
            if self._is_draining:
                raise Unavailable("the server is shutting down")
            if not self.is_alive:
                raise Unavailable(f"the engine loop has stopped: {self.error}")
            if self.recorder is not None and self.recorder.writer.is_buffer_full:
                state = self.recorder.writer.buffer_state()
                raise Overloaded(
                    f"the ledger is unreachable ({state.last_error}) and {state.buffered_bytes} bytes of records "
                    f"wait for it (--ledger-buffer-mb); retry later",
                    retry_after_s=LEDGER_RETRY_AFTER_S,
                    status=503,
                )
            running = self.engine.config.max_num_seqs
            if self._num_open + len(submissions) > running + self.max_queued:
                raise Overloaded(
                    f"the server is at capacity: {running} requests running and {self.max_queued} waiting "
                    "(--max-queued); retry later",
                    retry_after_s=1,
                )
            self._num_open += len(submissions)
            self._inbox += submissions
        self._wakeup.set()

    def cancel(self, request_id: str, why: str) -> None:
        """End a request before it finishes (its client went away): between steps it leaves the engine, its KV
        freed, and is recorded as cancelled. A request that already ended is left alone."""
        with self._lock:
            self._cancels[request_id] = why
        self._wakeup.set()

    def stop_admitting(self) -> None:
        """Refuse new requests from now on (the server is told to stop); in-flight ones keep being served, and
        one ended from now on (its stream closed by the shutdown) counts as interrupted."""
        with self._lock:
            self._is_draining = True
        self._wakeup.set()

    def drain(self, grace_s: float) -> str:
        """Stop admitting, let in-flight requests finish for `grace_s`, end the rest; returns the run status
        ("complete", "incomplete" when requests were interrupted, "failed" after an engine error)."""
        with self._lock:
            self._is_draining = True
            self._deadline = time.monotonic() + grace_s
        self._wakeup.set()
        self._thread.join()
        if self.error is not None:
            return "failed"
        return "incomplete" if self.num_interrupted else "complete"

    # --- the loop thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                self._admit()
                if self._deadline is not None and time.monotonic() > self._deadline:
                    self._interrupt_all()
                    return
                if not self.engine.has_unfinished():
                    if self._is_draining:
                        return
                    self._wakeup.wait(0.05)
                    self._wakeup.clear()
                    continue
                self._step()
        except BaseException as exc:  # noqa: BLE001 - every waiting handler gets the error; the run is failed
            self.error = exc
            for sub in list(self._pending.values()):
                self._push(sub, Failed(f"engine failed: {exc}", 500))
            self._pending.clear()

    def _admit(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, {}
        now = time.monotonic()
        for sub in inbox:
            if sub.request_id in cancels:
                self._push(sub, Failed(cancels.pop(sub.request_id), 499, "cancelled"))
                continue
            sub.is_audited = self.recorder is not None and self.sampler.draw()
            try:
                self.engine.add_request(sub.token_ids, sub.params, sub.request_id, sub.request_class,
                                        is_logits_kept=sub.is_audited, session_id=sub.session_id)  # fmt: skip
            except (EngineError, ValueError) as exc:
                self._push(sub, Failed(str(exc)))
                continue
            self._pending[sub.request_id] = sub
            self.metrics.in_flight.inc()
        for rid, why in cancels.items():
            if rid in self._pending:
                self._end_early(self._pending[rid], Failed(why, 499, "cancelled"), "cancelled")
        for sub in [s for s in self._pending.values() if s.deadline_s is not None and now > s.deadline_s]:
            self._end_early(sub, Failed("timeout: the request ran past its time limit", 504, "timeout"), "timeout")

    def _end_early(self, sub: Submission, reply: Failed, outcome: str) -> None:
        """End an admitted request between steps, record it as cancelled and tell its handler `reply`."""
        output = self.engine.abort_request(sub.request_id)
        del self._pending[sub.request_id]
        if self.recorder is not None:
            self.recorder.on_request(output, prompt=sub.prompt, status="cancelled")
            self.recorder.forget(sub.request_id)
            self.num_cancelled += 1
        if self._is_draining:  # ended during shutdown (the server closes the streams it waited for): the run is cut
            self.num_interrupted += 1
        self.metrics.in_flight.dec()
        self.metrics.requests.labels(sub.request_class, outcome).inc()
        self._push(sub, reply)

    def _step(self) -> None:
        result = self.engine.step()
        plan = self.engine.last_plan
        if self.recorder is not None and plan is not None:
            self.recorder.on_step(plan, result)
        classes = {rid: sub.request_class for rid, sub in self._pending.items()}
        self.metrics.on_step(result, self.engine, classes)
        for rid, token in result.sampled_token_ids.items():
            if rid in self._pending and rid not in result.finished_ids:
                sub = self._pending[rid]
                text = self._stopped_text(sub) if sub.stop_strings else None
                if text is None:
                    if sub.is_streamed:
                        self._push(sub, Token(token))
                else:  # a stop string: it ends here, as finished
                    del self._pending[rid]
                    self._finish(sub, self.engine.abort_request(rid), text)
        for rid in result.finished_ids:
            output = self.engine.finished.pop(rid)
            sub = self._pending.pop(rid)
            text = self._stopped_text(sub, output.output_token_ids) if sub.stop_strings else None
            self._finish(sub, output, text)
        for rid, why in result.failed.items():  # a fault only it met; everyone else keeps being served
            output, _ = self.engine.failed.pop(rid)
            if rid in self._pending:
                self._fail(self._pending.pop(rid), output, why)

    def _fail(self, sub: Submission, output: RequestOutput, why: str) -> None:
        """A request the engine ended failed (a quarantined expert, an unreadable KV block): recorded as failed,
        its handler told with a 500 that names the fault."""
        if self.recorder is not None:
            self.recorder.on_request(output, prompt=sub.prompt, status="failed")
            self.recorder.forget(sub.request_id)
        self.metrics.in_flight.dec()
        self.metrics.requests.labels(sub.request_class, "failed").inc()
        code = "expert_quarantined" if why.startswith("quarantined") else "kv_unreadable"
        self._push(sub, Failed(f"request {sub.request_id} failed: {why}", 500, code))

    def _stopped_text(self, sub: Submission, token_ids: list[int] | None = None) -> str | None:
        """The output text cut before its first stop string, or None while no stop string has appeared."""
        ids = token_ids if token_ids is not None else self.engine.sequences[sub.request_id].output_token_ids
        text = self.engine.tokenizer.decode(ids, skip_special_tokens=True)
        at = sub.stop_strings.first(text, sub.stop_strings.search_start(sub.num_checked_chars))
        sub.num_checked_chars = len(text)
        return None if at is None else text[:at]

    def _finish(self, sub: Submission, output: RequestOutput, stopped_text: str | None = None) -> None:
        if self.recorder is not None:
            self.recorder.on_request(output, prompt=sub.prompt)
            if sub.is_audited:
                self.recorder.defer_audits([output])
                output.output_logits = None  # stored: the response does not need them
            self.recorder.forget(output.request_id)
        self.metrics.in_flight.dec()
        self.metrics.on_finish(output, self.slos.get(sub.request_class), "ok")
        is_stop = bool(output.output_token_ids) and output.output_token_ids[-1] in sub.params.stop_token_ids
        is_stop = is_stop or stopped_text is not None
        self._push(sub, Done(output, "stop" if is_stop else "length", stopped_text))

    def _interrupt_all(self) -> None:
        """Past the grace period: every request still running ends; its row records it as cancelled."""
        for rid, sub in list(self._pending.items()):
            if self.recorder is not None:
                self.recorder.on_request(self.engine.partial_output(rid), prompt=sub.prompt, status="cancelled")
                self.recorder.forget(rid)
                self.num_cancelled += 1
            self._push(sub, Failed("interrupted: the server shut down before this request finished", 503))
            self.num_interrupted += 1
            self.metrics.requests.labels(sub.request_class, "interrupted").inc()
        self._pending.clear()

    def _push(self, sub: Submission, item: Reply) -> None:
        if not isinstance(item, Token):
            with self._lock:
                self._num_open -= 1  # its final reply: it no longer counts against the admission queue
        sub.loop.call_soon_threadsafe(sub.queue.put_nowait, item)

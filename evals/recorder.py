"""Record an evaluation run to the ledger: every step, every request, audits against the exact baseline.

Scoring requests (``RequestOutput.prompt_logits`` set) are audited at their scored positions: the engine's
prefill logits there against one exact teacher-forced pass over the same tokens. Generation requests are
audited as ``fallbackgate run`` audits them (:func:`fallbackgate.audit.auditor.audit_output`).
"""

from __future__ import annotations

from fallbackgate.assembly import Assembly
from fallbackgate.audit.auditor import AuditSampler, audit_output, numeric_floor
from fallbackgate.audit.gate import RunVerdict
from fallbackgate.audit.stats import PositionDiff, RequestDiffStats, audit
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.messages import RequestOutput, StepPlan, StepResult
from fallbackgate.ledger.db import Ledger, open_ledger
from fallbackgate.ledger.writer import LedgerWriter
from fallbackgate.recording import RunRecorder


def scored_targets(output: RequestOutput) -> list[int]:
    """Tokens the scored rows predict: the prompt's next tokens, then the token the engine emitted."""
    n = len(output.prompt_logits)
    return output.prompt_token_ids[len(output.prompt_token_ids) - n + 1 :] + output.output_token_ids[:1]


def audit_scored(
    engine: Engine, output: RequestOutput, num_chunked: int = 0
) -> tuple[list[PositionDiff], RequestDiffStats]:
    """Diffs of a scoring request's prefill logits against the exact baseline at the same positions."""
    n = len(output.prompt_logits)
    exact = engine.exact_logits(output.prompt_token_ids, num_chunked)[-n:]
    return audit(exact, output.prompt_logits, scored_targets(output))


def scored_floor(engine: Engine, output: RequestOutput) -> float:
    """Numeric floor of a scoring request: max KL of one exact pass against a token-by-token exact pass."""
    n = len(output.prompt_logits)
    one_pass = engine.exact_logits(output.prompt_token_ids)[-n:]
    chunked = engine.exact_logits(output.prompt_token_ids, num_chunked=min(n, len(output.prompt_token_ids) - 1))[-n:]
    return audit(one_pass, chunked, scored_targets(output))[1].max_kl


class EvalRecorder:
    """Writes one assembled engine's evaluation run to a ledger (URL or open ledger; None: the default);
    call :meth:`finish` at the end. Requests are audited as they finish, the first always, the rest with
    probability ``audit_rate`` (seeded)."""

    def __init__(self, assembly: Assembly, ledger: str | Ledger | None, note: str = "") -> None:
        self.engine = assembly.engine
        self._opened = None if isinstance(ledger, Ledger) else open_ledger(ledger)
        self.recorder: RunRecorder | None = assembly.recorder(LedgerWriter(self._opened or ledger), note=note)
        self.run_id = self.recorder.run_id
        self._sampler = AuditSampler(assembly.audit_rate, assembly.settings.seed)
        self._floor: float | None = None
        self.verdict: RunVerdict | None = None

    @property
    def num_audited(self) -> int:
        """Requests audited so far."""
        return self.recorder.num_audited if self.recorder is not None else 0

    def on_step(self, plan: StepPlan, result: StepResult) -> None:
        """Record one engine step and its events."""
        self.recorder.on_step(plan, result)

    def on_finish(self, output: RequestOutput, step_ids: list[int]) -> None:
        """Record a finished request; audit it with probability `audit_rate` (the first one always)."""
        recorder = self.recorder
        recorder.on_request(output)
        if recorder.num_audited and not self._sampler.draw():
            return
        if output.prompt_logits is not None:
            diffs, stats = audit_scored(self.engine, output)
            recorder.record_audit(output.request_id, diffs, stats, step_ids=[s if s >= 0 else None for s in step_ids])
            floor = scored_floor(self.engine, output) if self._floor is None else None
        else:
            diffs, stats = audit_output(self.engine, output)
            recorder.record_audit(output.request_id, diffs, stats)
            floor = numeric_floor(self.engine, output) if self._floor is None else None
        self._floor = floor if floor is not None else self._floor

    def finish(self, status: str = "complete") -> RunVerdict | None:
        """Record the numeric floor, finish the run, close the writer and judge the run (once)."""
        if self.recorder is None:
            return self.verdict
        recorder, self.recorder = self.recorder, None
        try:
            if self._floor is not None:
                recorder.record_floor({"max_kl": self._floor, "dtype": self.engine.dtype_name})
            self.verdict = recorder.close(status)
        finally:
            if self._opened is not None:
                self._opened.close()
        return self.verdict

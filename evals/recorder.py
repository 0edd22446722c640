"""Record an evaluation run to the ledger: every step, every request, audits against the exact baseline.

Scoring requests (``RequestOutput.prompt_logits`` set) are audited at their scored positions: the engine's
prefill logits there against one exact teacher-forced pass over the same tokens. Generation requests are
audited as ``fallbackgate run`` audits them (:func:`fallbackgate.audit.auditor.audit_output`).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping
from typing import Any

from fallbackgate.audit.auditor import audit_output, numeric_floor
from fallbackgate.audit.gate import RunVerdict, evaluate_run
from fallbackgate.audit.stats import PositionDiff, RequestDiffStats, audit
from fallbackgate.batch.recording import versions
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.messages import RequestOutput, StepPlan, StepResult
from fallbackgate.ledger.db import Ledger, open_ledger
from fallbackgate.ledger.writer import LedgerWriter


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


@dataclasses.dataclass
class EvalRecorder:
    """Writes one engine's evaluation run to a ledger (URL or open ledger); call :meth:`finish` at the end."""

    engine: Engine
    ledger: str | Ledger | None
    policy: str | None = None
    controller: str = "exact_lru"
    budgets: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    audit_rate: float = 1.0
    seed: int = 0
    note: str = ""

    def __post_init__(self) -> None:
        self._opened = None if isinstance(self.ledger, Ledger) else open_ledger(self.ledger)
        self.writer = LedgerWriter(self._opened or self.ledger)
        self.run_id = self.writer.start_run(
            policy=self.policy,
            model_path=self.engine.config.model_dir,
            controller=self.controller,
            hardware_profile=dataclasses.asdict(self.engine.config.profile),
            versions=versions(),
            mode="observe" if self.engine.is_observe else "enforce",
            note=self.note,
        )
        self._rng = random.Random(self.seed)
        self._floor: float | None = None
        self.num_audited = 0
        self.verdict: RunVerdict | None = None

    def on_step(self, plan: StepPlan, result: StepResult) -> None:
        """Record one engine step and its events."""
        self.writer.record_step(plan, result)

    def on_finish(self, output: RequestOutput, step_ids: list[int]) -> None:
        """Record a finished request; audit it with probability `audit_rate` (the first one always)."""
        self.writer.record_request(output, budget=self.budgets.get(output.request_class))
        if self.num_audited and self._rng.random() >= self.audit_rate:
            return
        if output.prompt_logits is not None:
            diffs, stats = audit_scored(self.engine, output)
            self.writer.record_diffs(
                output.request_id, diffs, stats, step_ids=[s if s >= 0 else None for s in step_ids]
            )
            floor = scored_floor(self.engine, output) if self._floor is None else None
        else:
            diffs, stats = audit_output(self.engine, output)
            self.writer.record_diffs(output.request_id, diffs, stats)
            floor = numeric_floor(self.engine, output) if self._floor is None else None
        self._floor = floor if floor is not None else self._floor
        self.num_audited += 1

    def finish(self, status: str = "complete") -> RunVerdict | None:
        """Record the numeric floor, finish the run, close the writer and judge the run (once)."""
        if self.writer is None:
            return self.verdict
        try:
            if self._floor is not None:
                floor = {"max_kl": self._floor, "dtype": self.engine.dtype_name}
                self.writer.record_control(self._floor, floor=floor)
            self.writer.finish_run(status=status)
            self.writer.close()
            if self.num_audited and status == "complete":
                self.verdict = evaluate_run(self.writer.ledger, self.run_id)
        finally:
            self.writer = None
            if self._opened is not None:
                self._opened.close()
        return self.verdict

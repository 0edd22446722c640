"""Serve prompts on a built engine, recorded, audited and judged as ``fallbackgate run`` does (tests and
benchmarks get the same ledger rows and the same verdict from their own engines)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from fallbackgate.audit.gate import RunVerdict
from fallbackgate.batch.prompts import PromptSpec
from fallbackgate.batch.session import RunOutcome, RunSettings
from fallbackgate.controllers import controller_class, registered_kinds
from fallbackgate.engine.controller import Controller
from fallbackgate.engine.engine import Engine
from fallbackgate.ledger.db import Ledger, open_ledger
from fallbackgate.ledger.writer import LedgerWriter
from fallbackgate.recording.recorder import RequestClasses, RunRecorder, RunRow


@dataclasses.dataclass(kw_only=True, slots=True)
class RecordedRun:
    """A served, recorded, audited and judged run."""

    run_id: int  # the run's id in the ledger
    outcome: RunOutcome  # what the engine produced, in prompt order
    verdict: RunVerdict | None  # the gate's verdict, read back from the ledger
    num_audited: int  # requests audited against the exact baseline


def as_specs(prompts: Sequence[PromptSpec | str]) -> list[PromptSpec]:
    """Prompt specs from specs or plain texts (texts get ids ``prompt-<i>`` and the default class)."""
    return [p if isinstance(p, PromptSpec) else PromptSpec(p, f"prompt-{i}") for i, p in enumerate(prompts)]


def controller_kind(controller: Controller) -> str:
    """The kind ``controller``'s class is registered for (its class name when it registers none)."""
    for kind in registered_kinds():
        if type(controller) is controller_class(kind):
            return kind.value
    return type(controller).__name__


def record_and_judge(
    engine: Engine,
    prompts: Sequence[PromptSpec | str],
    ledger: str | Ledger | LedgerWriter,
    *,
    settings: RunSettings | None = None,
    budgets: dict[str, dict] | None = None,
    audit_rate: float = 1.0,
    note: str = "",
    progress: bool = False,
) -> RecordedRun:
    """Serve ``prompts`` on ``engine`` recording every step to ``ledger`` (URL, open ledger or writer),
    audit against the exact baseline, and judge the run exactly as ``fallbackgate run`` does.

    ``settings`` supplies max_new_tokens / temperature / seed (default: 32 greedy tokens, the engine's
    seed); ``budgets`` maps request class to quality budget.
    """
    settings = settings or RunSettings(model_dir=engine.config.model_dir, seed=engine.config.seed)
    opened = open_ledger(ledger) if isinstance(ledger, str) else None
    writer = ledger if isinstance(ledger, LedgerWriter) else LedgerWriter(opened or ledger)
    classes = RequestClasses(budgets=dict(budgets or {}))
    try:
        recorder = RunRecorder(
            writer,
            engine,
            RunRow(controller=controller_kind(engine.controller), note=note),
            classes,
            audit_rate=audit_rate,
            seed=settings.seed,
        )
        outcome = recorder.serve(as_specs(prompts), settings, progress)
        verdict = recorder.finish(outcome)
    finally:
        writer.close()
        if opened is not None:
            opened.close()
    return RecordedRun(run_id=recorder.run_id, outcome=outcome, verdict=verdict, num_audited=recorder.num_audited)

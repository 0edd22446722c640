"""Serve prompts through an engine while recording every step to a ledger, then audit and judge the run.

This is what ``fallbackgate run`` does between building the engine and printing; tests and benchmarks
call :func:`record_and_judge` to get the same ledger rows and the same verdict from their own engines.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import transformers

from fallbackgate.audit.auditor import choose_audited
from fallbackgate.audit.gate import RunVerdict, evaluate_run
from fallbackgate.audit.run_audit import audit_outputs
from fallbackgate.audit.verdicts import record_verdicts
from fallbackgate.batch.prompts import PromptSpec
from fallbackgate.batch.session import RunOutcome, RunSettings, run_prompts
from fallbackgate.engine.engine import Engine
from fallbackgate.ledger.db import Ledger, LedgerError, open_ledger
from fallbackgate.ledger.writer import LedgerWriter

Budgets = Mapping[str, Mapping[str, Any]]  # request class -> quality budget (see fallbackgate.audit.gate)


@dataclasses.dataclass(slots=True)
class RecordedRun:
    """A served, recorded, audited and judged run."""

    run_id: int  # the run's id in the ledger
    outcome: RunOutcome  # what the engine produced, in prompt order
    verdict: RunVerdict  # the gate's verdict, read back from the ledger
    num_audited: int  # requests audited against the exact baseline


def as_specs(prompts: Sequence[PromptSpec | str]) -> list[PromptSpec]:
    """Prompt specs from specs or plain texts (texts get ids ``prompt-<i>`` and the default class)."""
    return [p if isinstance(p, PromptSpec) else PromptSpec(p, f"prompt-{i}") for i, p in enumerate(prompts)]


def versions() -> dict[str, str]:
    """Versions of fallbackgate, torch and transformers, for the run row."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        own = version("fallbackgate")
    except PackageNotFoundError:
        own = "source"
    return {"fallbackgate": own, "torch": torch.__version__, "transformers": transformers.__version__}


def start_run(
    writer: LedgerWriter,
    engine: Engine,
    *,
    controller: str = "exact_lru",
    note: str = "",
    policy: str | None = None,
    policy_name: str | None = None,
) -> int:
    """Insert the run row (status "running") describing ``engine``; returns the run id.

    ``policy`` is the effective policy as JSON and ``policy_name`` its file's stem (None: no policy file).
    """
    return writer.start_run(
        policy=policy,
        policy_name=policy_name,
        model_path=engine.config.model_dir,
        controller=controller,
        hardware_profile=dataclasses.asdict(engine.config.profile),
        versions=versions(),
        mode="observe" if engine.is_observe else "enforce",
        note=note,
        forced_tags=sorted(getattr(t, "value", str(t)) for t in getattr(engine.controller, "force", ())),
    )


def serve_recorded(
    engine: Engine, specs: list[PromptSpec], settings: RunSettings, writer: LedgerWriter, progress: bool = False
) -> RunOutcome:
    """Serve ``specs``, recording every step; a run that raises is marked failed before re-raising."""
    try:
        return run_prompts(engine, specs, settings, writer.record_step, progress)
    except BaseException as exc:
        _mark_failed(writer, "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed")
        raise


def _mark_failed(writer: LedgerWriter, status: str) -> None:
    """Mark the run `status` and close the writer, as far as the database still allows (a full disk may
    refuse even that: the run then stays "running", which queries report as incomplete, never PASS)."""
    try:
        writer.finish_run(status=status)
    except LedgerError:  # the queue holds a failed write: try the status alone, directly
        writer.mark_run_now(status)
    finally:
        try:
            writer.close()
        except LedgerError:
            pass


def audit_and_judge(
    engine: Engine,
    outcome: RunOutcome,
    writer: LedgerWriter,
    *,
    budgets: Budgets | None = None,
    audit_rate: float = 1.0,
    seed: int = 0,
    slos: Budgets | None = None,
    is_deferred: bool = False,
) -> tuple[RunVerdict | None, int]:
    """Record requests (with their class's SLO and budget), audit a sample, record the numeric-floor control,
    finish the run, judge it, record the verdicts and close the writer; returns the verdict and the number
    audited. Deferred: leave the sample's served logits and audit tasks in the ledger for ``fallbackgate
    audit`` workers instead, finish the run and return no verdict."""
    budgets, slos = budgets or {}, slos or {}
    try:
        audited = _record_and_audit(engine, outcome, writer, budgets, slos, audit_rate, seed, is_deferred)
    except BaseException as exc:
        _mark_failed(writer, "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed")
        raise
    if is_deferred:
        writer.close()
        return None, len(audited)
    verdict = evaluate_run(writer.ledger, writer.run_id)
    record_verdicts(writer, verdict)
    writer.close()
    return verdict, len(audited)


def _record_and_audit(engine: Engine, outcome: RunOutcome, writer: LedgerWriter, budgets: Budgets, slos: Budgets,
                      audit_rate: float, seed: int, is_deferred: bool = False) -> list[Any]:
    for spec, output in zip(outcome.specs, outcome.outputs, strict=True):
        writer.record_request(
            output, prompt=spec.prompt, budget=budgets.get(spec.request_class), slo=slos.get(spec.request_class)
        )
    audited = choose_audited(outcome.outputs, audit_rate, seed)
    writer.record_verifications(engine.verify_dense())  # the baselines compute with these dense weights
    if is_deferred:
        writer.queue_audits(audited)
        writer.record_memory(outcome.memory)
        writer.finish_run(status="complete")
        return audited
    writer.flush()  # the replay reads each request's trace back from the ledger
    results, floor = audit_outputs(engine, writer.ledger, writer.run_id, audited)
    for result in results:
        writer.record_diffs(result.request_id, result.diffs, result.stats)
        if result.replay is not None:
            writer.record_replay(result.request_id, {k: v for k, v in result.replay.items() if k != "error"})
    writer.record_control(floor["max_kl"], floor=floor)
    writer.record_memory(outcome.memory)
    writer.finish_run(status="complete")
    return audited


def record_and_judge(
    engine: Engine,
    prompts: Sequence[PromptSpec | str],
    ledger: str | Ledger | LedgerWriter,
    *,
    settings: RunSettings | None = None,
    budgets: Budgets | None = None,
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
    try:
        run_id = start_run(writer, engine, note=note)
        outcome = serve_recorded(engine, as_specs(prompts), settings, writer, progress)
        verdict, num_audited = audit_and_judge(
            engine, outcome, writer, budgets=budgets, audit_rate=audit_rate, seed=settings.seed
        )
    finally:
        writer.close()
        if opened is not None:
            opened.close()
    return RecordedRun(run_id, outcome, verdict, num_audited)

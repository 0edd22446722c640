"""Counted resident uses (issue 27 item 5): resident expert uses are counts on the step rows, not event rows;
a count the engine or the writer drops is still caught, and a correct run writes one event row per miss or
approximate action only."""

from __future__ import annotations

import pathlib

import pytest
from sqlalchemy import func, select

from fallbackgate.engine.step_context import EventLog
from fallbackgate.engine.tags import ObjectKind, Tag
from fallbackgate.ledger import rows as ledger_rows
from fallbackgate.ledger.db import open_ledger
from fallbackgate.ledger.models import EventRow, Step, StepRequest
from fallbackgate.recording import RecordedRun
from tests.test_planted_faults import FAULT_STEP, _engine, _judge
from tests.test_planted_faults import model as model  # noqa: F401 - the shared checkpoint fixture


def _ledger_counts(tmp_path: pathlib.Path, run_id: int) -> tuple[int, dict[int, int], int]:
    """(event rows, step -> num_resident_expert_uses, sum of step_requests.num_resident_expert_uses)."""
    with open_ledger(str(tmp_path / "ledger.sqlite")) as ledger, ledger.engine.connect() as conn:
        events = conn.execute(select(func.count()).where(EventRow.run_id == run_id)).scalar_one()
        steps = dict(
            conn.execute(select(Step.step_id, Step.num_resident_expert_uses).where(Step.run_id == run_id)).all()
        )
        per_request = conn.execute(
            select(func.sum(StepRequest.num_resident_expert_uses)).where(StepRequest.run_id == run_id)
        ).scalar_one()
    return int(events), steps, int(per_request)


def _engine_resident(recorded: RecordedRun) -> dict[int, int]:
    return {s.step_id: sum(sum(b.values()) for b in s.expert_resident_uses.values()) for s in recorded.outcome.steps}


@pytest.mark.parametrize("budget", ["none", "tight"])
def test_resident_uses_are_counts_and_a_correct_run_passes(
    budget: str, model: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    engine = _engine(model, device_budget_bytes=None) if budget == "none" else _engine(model)
    recorded = _judge(engine, tmp_path)
    assert recorded.verdict.passed, recorded.verdict
    events = [e for s in recorded.outcome.steps for e in s.events]
    assert not any(e.tag is Tag.RESIDENT and e.object_kind is ObjectKind.EXPERT and not e.note for e in events)
    num_events, steps, per_request = _ledger_counts(tmp_path, recorded.run_id)
    assert num_events == len(events)  # only misses (and the like) are rows
    assert steps == _engine_resident(recorded)  # the step row holds what the engine counted
    assert per_request == sum(steps.values()) > 0
    resident = sum(o.tag_counts.get(Tag.RESIDENT.value, 0) for o in recorded.outcome.outputs)
    assert resident == per_request  # the engine's per-request tag counts include the counted uses
    if budget == "none":
        assert num_events == 0  # everything resident: no event rows at all


def test_engine_drops_one_layers_resident_uses(
    model: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(model, device_budget_bytes=None)
    add, dropped = EventLog.add_expert_uses, []

    def drop(self: EventLog, request_id: str, layer: int, count: int) -> None:
        if self.step_id == FAULT_STEP and layer == 1 and not dropped:
            dropped.append(request_id)  # one use of one request in one layer goes unrecorded everywhere
            count -= 1
        add(self, request_id, layer, count)

    monkeypatch.setattr(EventLog, "add_expert_uses", drop)
    verdict = _judge(engine, tmp_path).verdict
    assert dropped and not verdict.passed
    culprit = next(v for v in verdict.requests if v.request_id == dropped[0])
    top_k = engine.executor.top_k
    expected = f"ledger incomplete at step {FAULT_STEP}: {top_k - 1} expert uses in layer 1 for 1 token(s)"
    assert any(r.startswith(expected) for r in culprit.reasons), culprit.reasons
    assert all(v.passed for v in verdict.requests if v.request_id != dropped[0])


@pytest.mark.parametrize("where", ["request-row", "step-row"])
def test_writer_drops_a_resident_count(
    where: str, model: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dropped: list[str] = []
    if where == "request-row":
        step_request_rows = ledger_rows._step_request_rows

        def drop_row_count(run_id, plan, result):
            out = step_request_rows(run_id, plan, result)
            if plan.step_id == FAULT_STEP:
                row = out[0]
                dropped.append(row[2])
                out[0] = (*row[:-3], 0, None, row[-1])  # the request's counted uses, total and per layer, zeroed
            return out

        monkeypatch.setattr(ledger_rows, "_step_request_rows", drop_row_count)
    else:
        total = ledger_rows._total

        def drop_step_count(counts):
            n = total(counts)
            if counts and n and not dropped and next(iter(counts.values())) and len(counts) > 1:
                dropped.append("step")
                return n - 1
            return n

        monkeypatch.setattr(ledger_rows, "_total", drop_step_count)
    recorded = _judge(_engine(model, device_budget_bytes=None), tmp_path)
    verdict = recorded.verdict
    assert dropped and not verdict.passed
    if where == "request-row":
        culprit = next(v for v in verdict.requests if v.request_id == dropped[0])
        assert any("objects per tag" in r and "resident" in r for r in culprit.reasons), culprit.reasons
        assert any(f"ledger incomplete at step {FAULT_STEP}: 0 expert uses" in r for r in culprit.reasons)
        assert any(f"step {FAULT_STEP} counted" in r for r in verdict.reasons), verdict.reasons
    else:
        assert any("resident expert uses, its request rows" in r for r in verdict.reasons), verdict.reasons

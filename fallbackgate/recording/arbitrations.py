"""Ledger rows of a step's arbitrations: the controller's decisions joined with what the engine measured."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fallbackgate.controllers.arbitration import Arbitration
from fallbackgate.engine.messages import StepResult
from fallbackgate.engine.tags import ObjectKind


def arbitration_rows(arbitrations: Sequence[Arbitration], result: StepResult) -> list[dict[str, Any]]:
    """One ``arbitrations`` row (without ``run_id``) per decision of `result`'s step: a KV block's measured
    arrival is when the engine had it usable (``StepResult.kv_stagings``), the stall how far past the step's
    deadline that was; an expert's when the engine had it usable for that request (``StepResult.expert_arrivals``:
    its disk read's end, served as the row's choice). One the step never fetched (deferred) has none: NULL."""
    ready = {(s.request_id, s.layer, s.block_index): s.ready_s for s in result.kv_stagings}
    arrived = {(e.request_id, e.layer, e.expert_id, e.tag): e.ready_s for e in result.expert_arrivals}
    rows = []
    for a in arbitrations:
        if a.step_id != result.step_id:
            raise ValueError(f"arbitration of step {a.step_id} recorded with step {result.step_id}")
        request_id, layer, object_id = a.object_key
        if a.object_kind is ObjectKind.KV_BLOCK:
            measured = ready.get(a.object_key)
        else:
            measured = arrived.get((*a.object_key, a.choice))
        rows.append(
            {
                "step_id": a.step_id,
                "request_id": request_id,
                "layer": layer,
                "object_kind": a.object_kind.value,
                "object_id": object_id,
                "late": a.late,
                "options": [
                    {
                        "tag": o.tag.value,
                        "predicted_s": o.predicted_s,
                        "predicted_cost": o.predicted_cost,
                        "is_feasible": o.is_feasible,
                        "note": o.note,
                    }
                    for o in a.options
                ],
                "choice": a.choice.value,
                "reason": a.reason,
                "predicted_cost": a.predicted_cost,
                "deadline_s": a.deadline_s,
                "predicted_arrival_s": a.predicted_arrival_s,
                "measured_arrival_s": measured,
                "stall_s": None if measured is None else max(0.0, measured - a.deadline_s),
                "audited_cost": None,
            }
        )
    return rows

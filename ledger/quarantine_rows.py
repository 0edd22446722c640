"""Ledger rows (quarantines table) of faults that stayed local: quarantined checkpoint objects and the
requests each touched."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from fallbackgate.engine.experts.quarantine import QuarantineRecord
from fallbackgate.engine.messages import StepResult
from fallbackgate.engine.tags import ObjectKind, Tag

QUARANTINED = "quarantined"  # a row about the object itself (request_id NULL)
_EXPERT = re.compile(r"quarantined: expert (\d+:\d+)")


def object_rows(records: Iterable[QuarantineRecord]) -> list[dict[str, Any]]:
    """One row per quarantined expert: its files and tensors, the manifest's hash and what was read."""
    return [
        {
            "request_id": None,
            "object_kind": ObjectKind.EXPERT.value,
            "object_id": r.object_id,
            "effect": QUARANTINED,
            "detail": {"tensors": r.tensors, "expected": r.expected, "found": r.found, "error": r.error},
        }
        for r in records
    ]


def request_row(request_id: str, why: str, effect: str) -> dict[str, Any]:
    """A request a fault touched (`effect`: "failed", "deferred" or "unaudited"), naming the object."""
    match = _EXPERT.search(why)
    kind, object_id = (ObjectKind.EXPERT.value, match[1]) if match else (ObjectKind.KV_BLOCK.value, "")
    return {"request_id": request_id, "object_kind": kind, "object_id": object_id, "effect": effect,
            "detail": {"error": why}}  # fmt: skip


def step_rows(result: StepResult, seen: set[tuple[str, str]]) -> list[dict[str, Any]]:
    """Requests the step failed, and those that deferred a quarantined expert (once per request and object)."""
    rows = [request_row(rid, why, "failed") for rid, why in result.failed.items()]
    for event in result.events:
        if event.tag is Tag.EXPERT_DEFER and "quarantined: " in event.note:
            row = request_row(event.request_id, event.note, "deferred")
            if (event.request_id, row["object_id"]) not in seen:
                seen.add((event.request_id, row["object_id"]))
                rows.append(row)
    return rows

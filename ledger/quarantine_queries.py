"""The quarantines table read back: a run's quarantined objects and the requests each touched."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from fallbackgate.ledger.db import Ledger
from fallbackgate.ledger.models import QuarantineRow
from fallbackgate.ledger.queries import _all


def quarantines(ledger: Ledger, run_id: int) -> list[dict[str, Any]]:
    """Every quarantine row of the run in the order written: objects (``request_id`` None) and requests."""
    q = QuarantineRow
    cols = (q.request_id, q.object_kind, q.object_id, q.effect, q.detail)
    return _all(ledger, select(*cols).where(q.run_id == run_id).order_by(q.id))


def unauditable(ledger: Ledger, run_id: int) -> tuple[dict[str, list[str]], list[str]]:
    """Requests a quarantined object touched (request id -> objects, "expert 2:0" or "kv_block"), and
    every quarantined object of the run (the run's own verdict names them)."""
    by_request: dict[str, list[str]] = {}
    objects: list[str] = []
    for row in quarantines(ledger, run_id):
        name = f"{row['object_kind']} {row['object_id']}".strip()
        if row["request_id"] is None:
            objects += [name] if name not in objects else []
        elif name not in by_request.setdefault(row["request_id"], []):
            by_request[row["request_id"]].append(name)
    for names in by_request.values():  # a failed KV read quarantines nothing by itself: the run names it too
        objects += [n for n in names if n not in objects]
    return by_request, objects

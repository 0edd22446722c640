"""Column order of the rows :func:`fallbackgate.ledger.rows.step_rows` builds as tuples (the bulk insert's fast
path), per table."""

from __future__ import annotations

from sqlalchemy import Table

from fallbackgate.ledger.models import EventObjectsRow, EventRow, Step, StepRequest

EVENT_KEY_COLUMNS: tuple[str, ...] = ("run_id", "step_id", "request_id", "layer", "object_kind", "tag")
"""The leading columns an event row and its objects row share."""
EVENT_COLUMNS: tuple[str, ...] = (
    *EVENT_KEY_COLUMNS,
    "exactness",
    "count",
    "bytes_moved",
    "source_tier",
    "predicted_cost",
    "modeled_s",
    "note",
)
"""Column order of the event tuples that :func:`~fallbackgate.ledger.rows.step_rows` produces."""
STEP_COLUMNS: tuple[str, ...] = (
    "run_id",
    "step_id",
    "kind",
    "num_requests",
    "num_tokens",
    "is_observe",
    "wall_s",
    "modeled_s",
    "device_bytes_expert",
    "device_bytes_kv",
    "num_events",
    "num_verified",
    "transfer_s",
    "transfer_exposed_s",
    "num_predicted_reads",
    "num_predicted_used",
    "num_unpredicted_reads",
    "num_resident_expert_uses",
    "num_resident_kv_reads",
)
"""Column order of the step tuples that :func:`~fallbackgate.ledger.rows.step_rows` produces."""
STEP_REQUEST_COLUMNS: tuple[str, ...] = (
    "run_id",
    "step_id",
    "request_id",
    "start_position",
    "num_tokens",
    "is_sampled",
    "num_events",
    "num_objects",
    "kv_resident_reads",
    "rebuild_objects",
    "num_resident_expert_uses",
    "resident_expert_uses",
    "routing_digests",
)
"""Column order of the step_requests tuples that :func:`~fallbackgate.ledger.rows.step_rows` produces."""
EVENT_OBJECT_COLUMNS: tuple[str, ...] = (
    *EVENT_KEY_COLUMNS,
    "bits",
    "is_rebuild",
    "object_ids",
)
"""Column order of the event_objects tuples that :func:`~fallbackgate.ledger.rows.step_rows` produces."""
TUPLE_COLUMNS: dict[Table, tuple[str, ...]] = {
    Step.__table__: STEP_COLUMNS,  # type: ignore[dict-item]
    EventRow.__table__: EVENT_COLUMNS,  # type: ignore[dict-item]
    StepRequest.__table__: STEP_REQUEST_COLUMNS,  # type: ignore[dict-item]
    EventObjectsRow.__table__: EVENT_OBJECT_COLUMNS,  # type: ignore[dict-item]
}
"""Tables whose pending rows are tuples (the bulk fast path), with their column order."""

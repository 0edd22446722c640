"""SQLAlchemy 2.x models of the ledger: every table, declared in the ``models_*`` modules by what it records.

Enum-valued columns (``tag``, ``object_kind``, ``exactness``, ``source_tier``, ``kind``) hold the
``.value`` strings of the engine's enums (``fallbackgate.engine.tags``, ``fallbackgate.engine.messages``),
so the ledger reads without importing the engine. The schema itself is created by the Alembic migrations in
``ledger/migrations``; ``Base.metadata`` mirrors it and a test checks that they agree. Importing this module
registers every table on ``Base.metadata`` (the migrations and ``create_all`` import ``Base`` from here).
"""

from __future__ import annotations

from fallbackgate.ledger.models_analyses import Calibration, TraceAnalysisRow
from fallbackgate.ledger.models_audit import (
    AuditTask,
    PositionDiffRow,
    RequestStatRow,
    ServedLogitsRow,
    VerdictRow,
    VerificationRow,
)
from fallbackgate.ledger.models_base import RUN_STATUSES, Base, utcnow
from fallbackgate.ledger.models_events import ArbitrationRow, EventObjectsRow, EventRow, KVCopyRow, QuarantineRow
from fallbackgate.ledger.models_runs import Request, Run, Step, StepRequest

__all__ = [
    "RUN_STATUSES",
    "ArbitrationRow",
    "AuditTask",
    "Base",
    "Calibration",
    "EventObjectsRow",
    "EventRow",
    "KVCopyRow",
    "PositionDiffRow",
    "QuarantineRow",
    "Request",
    "RequestStatRow",
    "Run",
    "ServedLogitsRow",
    "Step",
    "StepRequest",
    "TraceAnalysisRow",
    "VerdictRow",
    "VerificationRow",
    "utcnow",
]

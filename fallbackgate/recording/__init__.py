"""Recording a run to the ledger: one :class:`RunRecorder` for batch runs, the HTTP server, lm-eval and the sweep."""

from fallbackgate.recording.record import RecordedRun, as_specs, controller_kind, record_and_judge
from fallbackgate.recording.recorder import RequestClasses, RunRecorder, RunRow, versions

__all__ = [
    "RecordedRun",
    "RequestClasses",
    "RunRecorder",
    "RunRow",
    "as_specs",
    "controller_kind",
    "record_and_judge",
    "versions",
]

"""The engine's own transfers in a step's log: tail blocks read back on resume, prefetches started at step end."""

from __future__ import annotations

from fallbackgate.engine.experts.sources import ExpertKey
from fallbackgate.engine.experts.weights import Fetched
from fallbackgate.engine.hardware import HardwareProfile
from fallbackgate.engine.kv.block import Staged
from fallbackgate.engine.step_context import EventLog
from fallbackgate.engine.tags import ObjectKind, Tag

ENGINE_REQUEST_ID = "__engine__"  # events not caused by one request (prefetches)


def log_resumed(log: EventLog, profile: HardwareProfile, restored: list[tuple[str, Staged]]) -> None:
    """Each resumed request's tail block brought back during scheduling, as an exact load of its own."""
    for request_id, staged in restored:
        if log.capture is not None:  # the resume's read is not timed: it ran inside scheduling
            log.capture.kv_served[staged.key] = (staged.source_tier, Tag.EXACT_LOAD, staged.bytes_moved, 0)
        log.add_transfer(
            profile,
            request_id,
            staged.key[1],
            ObjectKind.KV_BLOCK,
            Tag.EXACT_LOAD,
            staged.bytes_moved,
            staged.source_tier,
            note="resume: tail block",
        )


def log_prefetches(log: EventLog, profile: HardwareProfile, started: list[tuple[ExpertKey, Fetched]]) -> None:
    """The prefetches the controller chose at step end, charged to the engine (no one request caused them)."""
    for key, fetched in started:
        log.add_transfer(
            profile,
            ENGINE_REQUEST_ID,
            key[0],
            ObjectKind.EXPERT,
            Tag.EXACT_LOAD,
            fetched.bytes_moved,
            fetched.source_tier,
            note="prefetch after defer",
        )

"""Who a disk transfer is for and how urgent it is, carried to the code that submits it.

The callers that know (the executor knows which requests need an expert, the KV store which request owns a
block) set an :class:`IOContext` around a fetch; the readers below them (checkpoint spans, spill records)
submit with it. Each transfer's finish time is noted on the context, so the caller can report when its
object arrived. Mechanism only: :class:`IOPriority` is the default order; a controller may set others.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
from collections.abc import Iterator, Sequence


class IOPriority(enum.IntEnum):
    """The serving order of disk transfers (lower first): what the current step waits on comes first."""

    KV_READ = 0  # KV blocks the current step attends over
    EXPERT_MISS = 1  # experts the current layer computes with and does not hold
    READ_AHEAD = 2  # experts read ahead of use (a prediction)
    KV_WRITE = 3  # KV blocks spilled to disk (nothing waits on their bytes arriving)


@dataclasses.dataclass(slots=True)
class IOContext:
    """What the transfers submitted inside one ``with io_context(...)`` are for."""

    requester_ids: tuple[str, ...] = ()  # requests waiting on the object (empty: the engine's own)
    priority: int | None = None  # serving order of its transfers (None: the reader's default for its kind)
    object_id: str = ""  # the object's id ("layer:expert", "request:layer:block"); "" lets the reader name it
    last_end_ns: int = 0  # monotonic_ns when the latest of its transfers finished (0: none yet)

    def note_end(self, end_ns: int) -> None:
        """A transfer for this object finished at `end_ns`."""
        self.last_end_ns = max(self.last_end_ns, end_ns)


_CURRENT: contextvars.ContextVar[IOContext | None] = contextvars.ContextVar("fallbackgate_io_context", default=None)


def current_io_context() -> IOContext:
    """The innermost context set in this thread (a fresh default one when none is)."""
    found = _CURRENT.get()
    return found if found is not None else IOContext()


@contextlib.contextmanager
def io_context(
    requester_ids: Sequence[str] = (), priority: int | None = None, object_id: str = ""
) -> Iterator[IOContext]:
    """Transfers submitted inside are for `requester_ids`, served at `priority`, for `object_id`; yields the
    context (its ``last_end_ns`` says when the last of them finished)."""
    ctx = IOContext(tuple(requester_ids), None if priority is None else int(priority), object_id)
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)

"""What an HTTP handler and the engine loop hand each other: a :class:`Submission` one way, its
:data:`Reply` items (tokens, then one :class:`Done` or :class:`Failed`) the other; and the two refusals
(:class:`Unavailable`, :class:`Overloaded`) a submission can meet."""

from __future__ import annotations

import asyncio
import dataclasses

from fallbackgate.api_server.stops import StopStrings
from fallbackgate.engine.messages import RequestOutput
from fallbackgate.engine.sequence import SamplingParams


class Unavailable(RuntimeError):
    """The server is draining or its engine loop has stopped."""


class Overloaded(RuntimeError):
    """The admission queue is full, or the ledger's buffer is: the client should retry later."""

    def __init__(self, message: str, retry_after_s: int, status: int = 429) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s  # what the Retry-After header says
        self.status = status  # 429: the queue is full; 503: the ledger is away and its buffer full


@dataclasses.dataclass(slots=True)
class Token:
    """A token sampled for the request (not its last)."""

    token_id: int  # the sampled token


@dataclasses.dataclass(slots=True)
class Done:
    """The request finished."""

    output: RequestOutput  # everything the engine produced for it
    finish_reason: str  # "stop" (a stop token or string) or "length"
    text: str | None = None  # the text cut before the stop string that ended it (None: decode every token)


@dataclasses.dataclass(slots=True)
class Failed:
    """The request ended without finishing."""

    message: str  # why: refused, interrupted by shutdown, timed out, cancelled, or the engine failed
    status: int = 400  # the HTTP status it means: 400 refused, 503 interrupted, 504 timed out, 500 engine failed
    code: str | None = None  # the OpenAI error code ("timeout", "cancelled", ...)


Reply = Token | Done | Failed


@dataclasses.dataclass(slots=True)
class Submission:
    """One HTTP request handed to the engine loop."""

    request_id: str  # the ledger's request id
    token_ids: list[int]  # tokenised prompt
    params: SamplingParams  # max tokens, temperature, seed, stop ids
    request_class: str  # a class of the policy
    prompt: str  # the text as received (recorded)
    loop: asyncio.AbstractEventLoop  # the handler's event loop
    queue: asyncio.Queue[Reply]  # what the engine loop hands back, in order
    stop_strings: StopStrings = dataclasses.field(default_factory=lambda: StopStrings(()))  # ends it when met
    deadline_s: float | None = None  # time.monotonic() past which it is ended as timed out (None: never)
    is_streamed: bool = True  # its handler wants every Token; a whole response waits for Done or Failed only
    is_audited: bool = False  # chosen for audit at admission: only then are its full logits kept
    num_checked_chars: int = 0  # characters of its decoded output already searched for stop strings
    session_id: str | None = None  # the client's conversation (None: none declared)

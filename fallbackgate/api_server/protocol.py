"""The OpenAI-compatible request shapes ``fallbackgate serve`` speaks.

Requests are validated with pydantic (unknown fields refused, so a typo is a 400 naming it). Implemented:
the four prompt forms of completions (a string, a list of strings, a list of token ids, a list of token-id
lists: one choice per prompt), ``stop`` strings, ``logprobs`` (completions: top-k; chat: ``logprobs`` with
``top_logprobs``), ``echo`` with the prompt's log-probabilities, ``top_p``, ``seed``. Accepted only at their
defaults, refused beyond them with a 400 naming the field: ``n``/``best_of`` (1), ``presence_penalty`` and
``frequency_penalty`` (0); ``logprobs`` or ``echo`` with ``stream``, and several prompts with ``stream``.
A request names its quality class in a ``fallbackgate`` object in the body (``{"class": "strict"}``) or the
``X-Fallbackgate-Class`` header, and may name its conversation there (``{"session": "chat-42"}``) or in the
``X-Fallbackgate-Session`` header: the engine then keeps its prefix blocks for the session's next turn.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
MAX_TOP_LOGPROBS = 20  # the most alternatives per position a request may ask for
MAX_STOPS = 16  # stop strings per request at most (lm-eval sends its task's list and the EOS string)
MAX_PROMPTS = 256  # prompts in one completions request at most
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
"""Used when the tokenizer has no chat template (the bundled model has none): "role: content" lines, then
"assistant:"."""

NonEmptyText = Annotated[str, Field(min_length=1)]
MAX_SESSION_CHARS = 256  # a session id's length at most
CLASS_HEADER = "X-Fallbackgate-Class"  # names a request's quality class when its body does not
SESSION_HEADER = "X-Fallbackgate-Session"  # names a request's session when its body does not
SessionId = Annotated[str, Field(min_length=1, max_length=MAX_SESSION_CHARS)]


def _listed(value: Any) -> Any:
    """One string stands for a list of one."""
    return [value] if isinstance(value, str) else value


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in value)


def _prompts(value: Any) -> list[str | list[int]]:
    """The four prompt forms as one list of prompts (texts or token-id lists), each non-empty."""
    if isinstance(value, str) or _is_ids(value) and value:
        value = [value]
    if not isinstance(value, list) or not value:
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of token-id lists")
    if len(value) > MAX_PROMPTS:
        raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(value)}")
    for index, prompt in enumerate(value):
        if not (isinstance(prompt, str) or _is_ids(prompt)):
            raise ValueError(f"prompt {index} is neither a string nor a list of token ids")
        if not prompt:
            raise ValueError(f"prompt {index} is empty")
    return value


class FallbackgateOptions(BaseModel):
    """The ``fallbackgate`` object of a request body."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    request_class: str | None = Field(default=None, alias="class")
    timeout_s: Annotated[float, Field(gt=0.0, le=86_400.0)] | None = None  # this request's own time limit
    session: SessionId | None = None  # the conversation it continues or starts (its kept blocks wait for the next turn)


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: Annotated[int, Field(ge=1, le=4096)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=4096)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: Annotated[list[NonEmptyText], BeforeValidator(_listed), Field(max_length=MAX_STOPS)] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: Literal[1] = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    fallbackgate: FallbackgateOptions | None = None

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty_at_default(cls, value: float) -> float:
        if value != 0.0:
            raise ValueError("only 0 is supported (penalties are not implemented)")
        return value

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The stop strings as a tuple (none: empty)."""
        return tuple(self.stop or ())


class CompletionRequest(_Common):
    """POST /v1/completions."""

    prompt: Annotated[list[str | list[int]], BeforeValidator(_prompts)]  # one entry per prompt: text or token ids
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    best_of: Literal[1] | None = None

    def refused(self) -> tuple[str, str] | None:
        """(field, why) for a combination not implemented; None when the request can be served."""
        if self.stream and self.logprobs is not None:
            return "logprobs", "logprobs are not implemented with stream; send stream: false"
        if self.stream and self.echo:
            return "echo", "echo is not implemented with stream; send stream: false"
        if self.stream and len(self.prompts) > 1:
            return "prompt", "several prompts are not implemented with stream; send one prompt per request"
        return None

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: its text, or its token ids."""
        return self.prompt


class ChatMessage(BaseModel):
    """One message of a chat."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(_Common):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    def refused(self) -> tuple[str, str] | None:
        """(field, why) for a combination not implemented or not allowed; None when it can be served."""
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        if self.stream and self.logprobs:
            return "logprobs", "logprobs are not implemented with stream; send stream: false"
        return None

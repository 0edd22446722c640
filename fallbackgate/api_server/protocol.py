"""The OpenAI-compatible request and response shapes ``fallbackgate serve`` speaks.

Requests are validated with pydantic (unknown fields refused, so a typo is a 400 naming it); the features
fallbackgate does not implement (n > 1, logprobs, stop strings, tools) are refused rather than ignored.
A request names its quality class in a ``fallbackgate`` object in the body (``{"class": "strict"}``) or
the ``X-Fallbackgate-Class`` header.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
"""Used when the tokenizer has no chat template (the bundled model has none): "role: content" lines, then
"assistant:"."""


class FallbackgateOptions(BaseModel):
    """The ``fallbackgate`` object of a request body."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    request_class: str | None = Field(default=None, alias="class")


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: Annotated[int, Field(ge=1, le=4096)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=4096)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: Literal[1] = 1
    user: str | None = None
    fallbackgate: FallbackgateOptions | None = None


class CompletionRequest(_Common):
    """POST /v1/completions."""

    prompt: Annotated[str, Field(min_length=1)]


class ChatMessage(BaseModel):
    """One message of a chat."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(_Common):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]


def new_id(prefix: str) -> str:
    """An OpenAI-style object id."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def error_body(
    message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """An OpenAI-shaped error body."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(num_prompt: int, num_output: int) -> dict[str, int]:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output, "total_tokens": num_prompt + num_output}


def completion_body(
    rid: str, model: str, text: str, finish: str, extra: dict[str, Any], num_prompt: int, num_output: int, is_chat: bool
) -> dict[str, Any]:
    """A whole (non-streamed) completion or chat completion."""
    if is_chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        kind = "text_completion"
    return {
        "id": rid,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(num_prompt, num_output),
        "fallbackgate": extra,
    }


def chunk_body(
    rid: str, model: str, text: str, finish: str | None, is_chat: bool, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One server-sent chunk of a streamed completion."""
    if is_chat:
        delta = {"role": "assistant", "content": text} if text or finish is None else {}
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        kind = "text_completion"
    body: dict[str, Any] = {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": [choice]}
    if extra is not None:
        body["fallbackgate"] = extra
    return body

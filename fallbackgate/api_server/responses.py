"""The OpenAI-compatible response shapes ``fallbackgate serve`` answers with: whole completions and chat
completions (one choice per prompt, indexed), streamed chunks, errors, and log-probabilities in both
formats (completions: ``tokens``/``token_logprobs``/``top_logprobs``/``text_offset``; chat: ``content``
entries with ``token``, ``logprob``, ``bytes`` and ``top_logprobs``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from fallbackgate.engine.sequence import TokenLogprobs

TokenText = Callable[[int], str]  # token id -> its text


def new_id(prefix: str) -> str:
    """An OpenAI-style object id."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def error_body(
    message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """An OpenAI-shaped error body."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(num_prompt: int, num_output: int) -> dict[str, int]:
    """The ``usage`` object: tokens in, out and both."""
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output, "total_tokens": num_prompt + num_output}


def _top(entry: TokenLogprobs, k: int, token_text: TokenText) -> list[tuple[str, float]]:
    return [(token_text(i), v) for i, v in zip(entry.top_ids[:k], entry.top_logprobs[:k], strict=True)]


def completion_logprobs(
    token_ids: Sequence[int], entries: Sequence[TokenLogprobs | None], k: int, token_text: TokenText, offset: int = 0
) -> dict[str, Any]:
    """The completions ``logprobs`` object of `token_ids` (an entry None: no log-probability, as for the
    first echoed prompt token); `offset` is the first token's place in the choice's text."""
    tokens = [token_text(t) for t in token_ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    top: list[dict[str, float] | None] = []
    for entry in entries:
        if entry is None:
            top.append(None)
            continue
        alternatives: dict[str, float] = {}
        for text, value in _top(entry, k, token_text):
            alternatives.setdefault(text, value)  # two ids with one text: the likelier one stands
        top.append(alternatives)
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else e.logprob for e in entries],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_logprobs(entries: Sequence[TokenLogprobs], k: int, token_text: TokenText) -> dict[str, Any]:
    """The chat ``logprobs`` object: one ``content`` entry per output token with its top-`k` alternatives."""

    def one(text: str, value: float) -> dict[str, Any]:
        return {"token": text, "logprob": value, "bytes": list(text.encode())}

    content = []
    for entry in entries:
        item = one(token_text(entry.token_id), entry.logprob)
        item["top_logprobs"] = [one(text, value) for text, value in _top(entry, k, token_text)]
        content.append(item)
    return {"content": content}


def completion_choice(index: int, text: str, finish: str, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    """One choice of a completion."""
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}


def chat_choice(index: int, text: str, finish: str, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    """One choice of a chat completion."""
    message = {"role": "assistant", "content": text}
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}


def completion_body(
    rid: str, model: str, choices: list[dict[str, Any]], num_tokens: tuple[int, int], extra: dict, is_chat: bool
) -> dict[str, Any]:
    """A whole (non-streamed) completion or chat completion; `num_tokens`: (prompt, output) over all choices."""
    return {
        "id": rid,
        "object": "chat.completion" if is_chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(*num_tokens),
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

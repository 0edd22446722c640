"""Reading a request into a :class:`Route`: the model it names, its quality class, session, time limit and
prompts, each checked with an OpenAI-shaped error (:class:`ApiError`) that names what was wrong."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from fastapi import Request

from fallbackgate.api_server.protocol import (
    CLASS_HEADER,
    DEFAULT_CHAT_TEMPLATE,
    MAX_SESSION_CHARS,
    SESSION_HEADER,
    ChatRequest,
    CompletionRequest,
)
from fallbackgate.api_server.service import EngineService
from fallbackgate.api_server.serving import ApiError, Prompt, Route

DEFAULT_MAX_BODY_BYTES = 1 << 20  # a request body larger than this is refused (413) before it is read


@dataclasses.dataclass(slots=True)
class ServerInfo:
    """What the routes need besides the service."""

    model_name: str  # the id /v1/models lists and requests must name
    run_id: int | None  # the ledger run of this server start (None without a ledger)
    default_class: str  # a request naming no class gets this one
    on_shutdown: Callable[[], None]  # drains the engine and closes the run
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get 413 before they are read
    request_timeout_s: float | None = None  # a request's time limit unless its body names a shorter one
    api_key: str | None = None  # when set, /v1/ routes need "Authorization: Bearer <api_key>"


@dataclasses.dataclass(slots=True)
class RequestReader:
    """Reads validated bodies of one server's requests into routes and tokenised prompts."""

    service: EngineService  # the engine's tokenizer, vocabulary and quality classes
    info: ServerInfo  # the model name, default class, run and time limit

    def route(self, body: CompletionRequest | ChatRequest, request: Request) -> Route:
        """The route of a request naming this server's model (else a 404 naming the one served)."""
        if body.model != self.info.model_name:
            raise ApiError(
                404,
                f"model {body.model!r} is not served here; /v1/models lists {self.info.model_name!r}",
                "model",
                "model_not_found",
            )
        asked = body.fallbackgate.timeout_s if body.fallbackgate is not None else None
        limits = [t for t in (asked, self.info.request_timeout_s) if t is not None]
        timeout_s = min(limits) if limits else None
        request_class = self.class_of(body, request)
        return Route(body, request_class, self.info.run_id, timeout_s, session_of(body, request))

    def class_of(self, body: CompletionRequest | ChatRequest, request: Request) -> str:
        """The class the body names, else the class header, else the server's default; an unknown one is a
        400 that lists the classes."""
        named = body.fallbackgate.request_class if body.fallbackgate is not None else None
        named = named or request.headers.get(CLASS_HEADER) or self.info.default_class
        if named not in self.service.classes:
            classes = ", ".join(sorted(self.service.classes))
            raise ApiError(
                400,
                f"unknown quality class {named!r}; the classes are: {classes}",
                "fallbackgate.class",
                "unknown_class",
            )
        return named

    def prompt(self, prompt: str | list[int], index: int) -> Prompt:
        """A completions prompt, text or token ids (each id inside the vocabulary, else a 400 naming it)."""
        tokenizer = self.service.engine.tokenizer
        if isinstance(prompt, str):
            return Prompt(prompt, tokenizer.encode(prompt))
        vocab = int(self.service.engine.model_config.vocab_size)
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ApiError(400, f"prompt {index}: token ids must be in [0, {vocab})", "prompt", "invalid_value")
        return Prompt(tokenizer.decode(prompt), list(prompt))

    def chat_prompt(self, body: ChatRequest) -> Prompt:
        """The chat's messages through the tokenizer's chat template (or the default one)."""
        tokenizer = self.service.engine.tokenizer
        messages: list[dict[str, Any]] = [m.model_dump() for m in body.messages]
        template = getattr(tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE
        text = tokenizer.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=True, tokenize=False
        )
        return Prompt(text, tokenizer.encode(text))


def session_of(body: CompletionRequest | ChatRequest, request: Request) -> str | None:
    """The session a request names: the body's ``fallbackgate.session`` (validated with the body), else the
    ``X-Fallbackgate-Session`` header (empty: none, as an empty class header names no class); an over-long
    header is a 400 naming it."""
    named = body.fallbackgate.session if body.fallbackgate is not None else None
    if named is not None:
        return named
    header = request.headers.get(SESSION_HEADER) or None
    if header is not None and len(header) > MAX_SESSION_CHARS:
        raise ApiError(
            400,
            f"a session id has 1 to {MAX_SESSION_CHARS} characters, got {len(header)}",
            SESSION_HEADER,
            "invalid_value",
        )
    return header

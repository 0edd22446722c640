"""The FastAPI app of ``fallbackgate serve``: OpenAI-compatible routes over one :class:`EngineService`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``"stream": true`` for server-sent
events), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text). Errors are OpenAI-shaped
JSON (``{"error": {"message", "type", "param", "code"}}``); an unknown quality class is a 400 that lists
the classes; a body over the limit is a 413 before it is read; a full admission queue is a 429 with
``Retry-After``, a full ledger buffer (the ledger away) a 503 with ``Retry-After``. Every response carries the
request's ledger id, class and tag counts in ``fallbackgate``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fallbackgate.api_server.protocol import (
    DEFAULT_CHAT_TEMPLATE,
    DEFAULT_MAX_TOKENS,
    ChatRequest,
    CompletionRequest,
    chunk_body,
    completion_body,
    error_body,
    new_id,
)
from fallbackgate.api_server.service import Done, EngineService, Failed, Overloaded, Submission, Unavailable
from fallbackgate.engine.sequence import SamplingParams

CLASS_HEADER = "X-Fallbackgate-Class"


DEFAULT_MAX_BODY_BYTES = 1 << 20  # a request body larger than this is refused (413) before it is read


class ApiError(Exception):
    """An error the client gets as OpenAI-shaped JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


class BodyLimit:
    """ASGI middleware: a request whose body exceeds `max_bytes` gets 413 at once, from its Content-Length
    before anything is read, or as soon as a chunked body's received bytes pass the limit (the body is
    gathered here, at most `max_bytes` of it, and handed on whole)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send, f"the request body ({int(declared)} bytes) exceeds")
            return
        parts: list[bytes] = []
        received = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            parts.append(message.get("body", b""))
            received += len(parts[-1])
            if received > self.max_bytes:
                await self._refuse(send, f"the request body (over {received} bytes so far) exceeds")
                return
            if not message.get("more_body", False):
                break
        whole: list[Message] = [{"type": "http.request", "body": b"".join(parts), "more_body": False}]

        async def replay() -> Message:
            return whole.pop() if whole else await receive()  # then disconnects, as the app listens for them

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send, what: str) -> None:
        message = f"{what} the server's limit of {self.max_bytes} bytes (--max-body-mb)"
        body = json.dumps(error_body(message, code="request_too_large")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers + [(b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


@dataclasses.dataclass(slots=True)
class ServerInfo:
    """What the routes need besides the service."""

    model_name: str  # the id /v1/models lists and requests must name
    run_id: int | None  # the ledger run of this server start (None without a ledger)
    default_class: str  # a request naming no class gets this one
    on_shutdown: Callable[[], None]  # drains the engine and closes the run
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get 413 before they are read


def build_app(service: EngineService, info: ServerInfo) -> FastAPI:
    """The app; its lifespan starts the engine loop and, at shutdown, drains it and closes the run."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, info.on_shutdown)

    app = FastAPI(title="fallbackgate", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=info.max_body_bytes)
    _errors(app)
    tokenizer = service.engine.tokenizer

    @app.get("/health")
    async def health() -> JSONResponse:
        body = {"status": "ok" if service.is_alive else "failed", "model": info.model_name, "run_id": info.run_id}
        if service.recorder is not None:
            body["ledger"] = dataclasses.asdict(service.recorder.writer.buffer_state())
        return JSONResponse(body, status_code=200 if service.is_alive else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": info.model_name, "object": "model", "owned_by": "fallbackgate"}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        if service.recorder is not None and info.run_id is not None:  # audits the background workers finished
            state = service.recorder.writer.buffer_state()
            service.metrics.on_ledger(state)
            if not state.is_retrying:
                loop = asyncio.get_running_loop()
                ledger = service.recorder.writer.ledger
                await loop.run_in_executor(None, service.metrics.poll_audits, ledger, info.run_id)
        return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _serve(body, body.prompt, tokenizer.encode(body.prompt), False, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatRequest, request: Request) -> Response:
        messages = [m.model_dump() for m in body.messages]
        template = getattr(tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE
        text = tokenizer.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=True, tokenize=False
        )
        return await _serve(body, text, tokenizer.encode(text), True, request)

    async def _serve(body: Any, text: str, token_ids: list[int], is_chat: bool, request: Request) -> Response:
        if body.model != info.model_name:
            raise ApiError(
                404,
                f"model {body.model!r} is not served here; /v1/models lists {info.model_name!r}",
                "model",
                "model_not_found",
            )
        request_class = _class_of(body, request)
        max_tokens = body.max_completion_tokens or body.max_tokens or DEFAULT_MAX_TOKENS
        stop = tuple(i for i in (tokenizer.eos_token_id,) if i is not None)
        params = SamplingParams(
            max_new_tokens=max_tokens, temperature=body.temperature, seed=body.seed, stop_token_ids=stop
        )
        rid = new_id("chatcmpl" if is_chat else "cmpl")
        queue: asyncio.Queue = asyncio.Queue()
        sub = Submission(rid, token_ids, params, request_class, text, asyncio.get_running_loop(), queue)
        try:
            service.submit(sub)
        except Unavailable as exc:
            raise ApiError(503, str(exc), code="unavailable") from None
        except Overloaded as exc:
            retry = {"Retry-After": str(exc.retry_after_s)}
            code = "too_many_requests" if exc.status == 429 else "ledger_unavailable"
            raise ApiError(exc.status, str(exc), code=code, headers=retry) from None
        if body.stream:
            return StreamingResponse(_stream(sub, body.model, is_chat), media_type="text/event-stream")
        while True:
            item = await queue.get()
            if isinstance(item, Failed):
                raise ApiError(400 if "interrupted" not in item.message else 503, item.message)
            if isinstance(item, Done):
                output = item.output
                content = tokenizer.decode(output.output_token_ids, skip_special_tokens=True)
                extra = _extra(output, info.run_id)
                num = (len(output.prompt_token_ids), len(output.output_token_ids))
                return JSONResponse(
                    completion_body(rid, body.model, content, item.finish_reason, extra, *num, is_chat)
                )

    def _class_of(body: Any, request: Request) -> str:
        named = body.fallbackgate.request_class if body.fallbackgate is not None else None
        named = named or request.headers.get(CLASS_HEADER) or info.default_class
        if named not in service.classes:
            classes = ", ".join(sorted(service.classes))
            raise ApiError(
                400,
                f"unknown quality class {named!r}; the classes are: {classes}",
                "fallbackgate.class",
                "unknown_class",
            )
        return named

    async def _stream(sub: Submission, model: str, is_chat: bool) -> AsyncIterator[str]:
        ids: list[int] = []
        sent = ""
        while True:
            item = await sub.queue.get()
            if isinstance(item, Failed):
                yield f"data: {json.dumps(error_body(item.message))}\n\n"
                break
            ids = list(item.output.output_token_ids) if isinstance(item, Done) else [*ids, item.token_id]
            text = tokenizer.decode(ids, skip_special_tokens=True)
            delta, sent = (text[len(sent) :], text) if text.startswith(sent) else ("", sent)
            if isinstance(item, Done):
                if delta:
                    yield f"data: {json.dumps(chunk_body(sub.request_id, model, delta, None, is_chat))}\n\n"
                extra = _extra(item.output, info.run_id)
                final = chunk_body(sub.request_id, model, "", item.finish_reason, is_chat, extra)
                yield f"data: {json.dumps(final)}\n\n"
                break
            if delta:
                yield f"data: {json.dumps(chunk_body(sub.request_id, model, delta, None, is_chat))}\n\n"
        yield "data: [DONE]\n\n"

    return app


def _extra(output: Any, run_id: int | None) -> dict[str, Any]:
    return {
        "request_id": output.request_id,
        "run_id": run_id,
        "class": output.request_class,
        "tag_counts": dict(output.tag_counts),
        "ttft_s": output.ttft_s,
        "tpot_s": output.tpot_s,
    }


def _errors(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        body = error_body(exc.message, kind, exc.param, exc.code)
        return JSONResponse(body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        return JSONResponse(error_body(message, param=where, code="invalid_value"), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), code=str(exc.status_code)), status_code=exc.status_code)

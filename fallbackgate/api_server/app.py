"""The FastAPI app of ``fallbackgate serve``: OpenAI-compatible routes over one :class:`EngineService`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``"stream": true`` for server-sent
events), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text). Errors are OpenAI-shaped
JSON (``{"error": {"message", "type", "param", "code"}}``); an unknown quality class is a 400 that lists
the classes; a body over the limit is a 413 before it is read; a full admission queue is a 429 with
``Retry-After``, a full ledger buffer (the ledger away) a 503 with ``Retry-After``; a request past its
time limit is a 504; with an API key, a /v1/ request without it is a 401. Every response carries the
request's ledger id, class and tag counts in ``fallbackgate``. What each request may ask is in
:mod:`protocol`; how it is served, in :mod:`serving`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fallbackgate.api_server.protocol import ChatRequest, CompletionRequest
from fallbackgate.api_server.responses import error_body
from fallbackgate.api_server.routing import RequestReader, ServerInfo
from fallbackgate.api_server.service import EngineService
from fallbackgate.api_server.serving import ApiError, Responder


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


class ApiKey:
    """ASGI middleware: a /v1/ request without ``Authorization: Bearer <key>`` gets 401 (``/health`` and
    ``/metrics`` stay open)."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                message = "a valid API key is needed: send 'Authorization: Bearer <key>' (serve --api-key)"
                body = json.dumps(error_body(message, code="invalid_api_key")).encode()
                headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                await send({"type": "http.response.start", "status": 401, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def build_app(service: EngineService, info: ServerInfo) -> FastAPI:
    """The app; its lifespan starts the engine loop and, at shutdown, drains it and closes the run."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, info.on_shutdown)

    app = FastAPI(title="fallbackgate", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=info.max_body_bytes)
    if info.api_key is not None:
        app.add_middleware(ApiKey, key=info.api_key)
    _errors(app)
    reader = RequestReader(service, info)
    responder = Responder(service)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse(_health(service, info), status_code=200 if service.is_alive else 503)

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
        route = reader.route(body, request)  # the model and class are checked before the prompts
        prompts = [reader.prompt(p, i) for i, p in enumerate(body.prompts)]
        return await responder.serve(route, prompts, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatRequest, request: Request) -> Response:
        route = reader.route(body, request)
        return await responder.serve(route, [reader.chat_prompt(body)], request)

    return app


def _health(service: EngineService, info: ServerInfo) -> dict[str, Any]:
    """The health body: alive or failed, the model and run, the ledger's buffer, the quarantined experts."""
    body = {"status": "ok" if service.is_alive else "failed", "model": info.model_name, "run_id": info.run_id}
    if service.recorder is not None:
        body["ledger"] = dataclasses.asdict(service.recorder.writer.buffer_state())
    body["quarantined"] = [  # requests that need one fail alone (or defer it); the rest are served
        {"object_kind": "expert", "object_id": r.object_id, "tensors": r.tensors, "expected": r.expected,
         "found": r.found, "error": r.error}
        for r in service.engine.expert_store.reader.quarantine.records()
    ]  # fmt: skip
    return body


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
        why = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        message = f"{where}: {why}" if where else why
        return JSONResponse(error_body(message, param=where, code="invalid_value"), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), code=str(exc.status_code)), status_code=exc.status_code)

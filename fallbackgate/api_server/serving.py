"""How one completions or chat request is served: its prompts become engine submissions (one per prompt),
their replies become choices (indexed as the prompts were) or a server-sent stream.

A handler that finds its client gone cancels its submissions (the engine loop ends them between steps, frees
their KV and records them as cancelled); so does a stream whose client went away. A stream never sends text
past a stop string: the end that could still become one is held back until the next token decides it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fallbackgate.api_server.protocol import DEFAULT_MAX_TOKENS, ChatRequest, CompletionRequest
from fallbackgate.api_server.responses import (
    chat_choice,
    chat_logprobs,
    chunk_body,
    completion_body,
    completion_choice,
    completion_logprobs,
    error_body,
    new_id,
)
from fallbackgate.api_server.service import EngineService
from fallbackgate.api_server.stops import StopStrings
from fallbackgate.api_server.submissions import Done, Failed, Overloaded, Submission, Unavailable
from fallbackgate.engine.messages import RequestOutput
from fallbackgate.engine.sequence import SamplingParams

DISCONNECT_POLL_S = 0.25  # how often a waiting handler checks that its client is still there
GONE = "cancelled: the client disconnected"


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


@dataclasses.dataclass(slots=True)
class Prompt:
    """One prompt of a request, tokenised."""

    text: str  # as received, or decoded from the token ids received (recorded; echoed)
    token_ids: list[int]  # what the engine is given


@dataclasses.dataclass(slots=True)
class Route:
    """What the request is and where it goes."""

    body: CompletionRequest | ChatRequest  # the validated body
    request_class: str  # the class it is served in
    run_id: int | None  # the ledger run of this server (None without a ledger)
    timeout_s: float | None  # its time limit from submission (None: none)
    session_id: str | None = None  # the conversation it belongs to (None: none declared)


class Responder:
    """Serves requests on one :class:`EngineService`."""

    def __init__(self, service: EngineService) -> None:
        self.service = service
        self.tokenizer = service.engine.tokenizer

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    async def serve(self, route: Route, prompts: list[Prompt], request: Request) -> Response:
        """Submit every prompt, then answer with one choice per prompt, or stream the only one."""
        body, is_chat = route.body, isinstance(route.body, ChatRequest)
        refused = body.refused()
        if refused is not None:
            raise ApiError(400, refused[1], refused[0], "unsupported_value")
        rid = new_id("chatcmpl" if is_chat else "cmpl")
        params = self._params(body)
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + route.timeout_s if route.timeout_s is not None else None
        subs = [
            Submission(
                rid if len(prompts) == 1 else f"{rid}-{i}",
                p.token_ids,
                params,
                route.request_class,
                p.text,
                loop,
                asyncio.Queue(),
                stop_strings=StopStrings(body.stop_strings),
                deadline_s=deadline,
                is_streamed=body.stream,
                session_id=route.session_id,
            )
            for i, p in enumerate(prompts)
        ]
        try:
            self.service.submit(*subs)
        except Unavailable as exc:
            raise ApiError(503, str(exc), code="unavailable") from None
        except Overloaded as exc:
            retry = {"Retry-After": str(exc.retry_after_s)}
            code = "too_many_requests" if exc.status == 429 else "ledger_unavailable"
            raise ApiError(exc.status, str(exc), code=code, headers=retry) from None
        if body.stream:
            return StreamingResponse(self._stream(subs[0], route, is_chat), media_type="text/event-stream")
        replies = await self._collect(subs, request)
        choices = [self._choice(i, body, prompts[i], done, is_chat) for i, done in enumerate(replies)]
        extras = [_extra(done.output, route.run_id) for done in replies]
        extra = extras[0] if len(extras) == 1 else _joint_extra(extras, route)
        num_prompt = sum(len(d.output.prompt_token_ids) for d in replies)
        num = (num_prompt, sum(len(d.output.output_token_ids) for d in replies))
        return JSONResponse(completion_body(rid, body.model, choices, num, extra, is_chat))

    def _params(self, body: CompletionRequest | ChatRequest) -> SamplingParams:
        stop_ids = tuple(i for i in (self.tokenizer.eos_token_id,) if i is not None)
        if isinstance(body, ChatRequest):
            top_k = (body.top_logprobs or 0) if body.logprobs else None
            prompt_k = None
        else:
            top_k = body.logprobs
            prompt_k = body.logprobs if body.echo else None
        return SamplingParams(
            max_new_tokens=body.max_completion_tokens or body.max_tokens or DEFAULT_MAX_TOKENS,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop_token_ids=stop_ids,
            num_top_logprobs=top_k,
            num_prompt_logprobs=prompt_k,
        )

    async def _collect(self, subs: list[Submission], request: Request) -> list[Done]:
        """Every submission's Done, in order; the first failure (or the client leaving) cancels the rest."""
        replies: list[Done] = []
        try:
            for sub in subs:
                while True:
                    try:
                        item = await asyncio.wait_for(sub.queue.get(), DISCONNECT_POLL_S)
                    except TimeoutError:  # a whole response gets no Token replies: nothing comes until it ends
                        if await request.is_disconnected():
                            raise ApiError(499, GONE, code="cancelled") from None
                        continue
                    if isinstance(item, Failed):
                        raise ApiError(item.status, item.message, code=item.code)
                    if isinstance(item, Done):
                        replies.append(item)
                        break
        except BaseException:
            for sub in subs[len(replies) :]:
                self.service.cancel(sub.request_id, GONE)
            raise
        return replies

    def _choice(
        self, index: int, body: CompletionRequest | ChatRequest, prompt: Prompt, done: Done, is_chat: bool
    ) -> dict[str, Any]:
        output = done.output
        text = done.text if done.text is not None else self.decode(output.output_token_ids)
        kept_ids = self._ids_in(output.output_token_ids, text) if done.text is not None else output.output_token_ids
        entries = (output.output_logprobs or [])[: len(kept_ids)]
        if isinstance(body, ChatRequest):
            logprobs = chat_logprobs(entries, body.top_logprobs or 0, self.token_text) if body.logprobs else None
            return chat_choice(index, text, done.finish_reason, logprobs)
        logprobs = None
        if body.logprobs is not None:
            ids, listed = list(kept_ids), list(entries)
            if body.echo:
                ids = output.prompt_token_ids + ids
                listed = [None, *(output.prompt_logprobs or []), *listed]
            logprobs = completion_logprobs(ids, listed, body.logprobs, self.token_text)
        return completion_choice(index, prompt.text + text if body.echo else text, done.finish_reason, logprobs)

    def _ids_in(self, token_ids: list[int], text: str) -> list[int]:
        """The leading tokens whose text begins inside `text` (the output cut before a stop string)."""
        kept, offset = [], 0
        for token in token_ids:
            if offset >= len(text):
                break
            kept.append(token)
            offset += len(self.token_text(token))
        return kept

    async def _stream(self, sub: Submission, route: Route, is_chat: bool) -> AsyncIterator[str]:
        model, ids, sent, is_over = route.body.model, [], "", False

        def chunk(text: str, finish: str | None = None, extra: dict | None = None) -> str:
            return f"data: {json.dumps(chunk_body(sub.request_id, model, text, finish, is_chat, extra))}\n\n"

        try:
            while True:
                item = await sub.queue.get()
                if isinstance(item, Failed):
                    is_over = True
                    yield f"data: {json.dumps(error_body(item.message, code=item.code))}\n\n"
                    break
                if isinstance(item, Done):
                    is_over = True
                    text = item.text if item.text is not None else self.decode(item.output.output_token_ids)
                    if text.startswith(sent) and len(text) > len(sent):
                        yield chunk(text[len(sent) :])
                    yield chunk("", item.finish_reason, _extra(item.output, route.run_id))
                    break
                ids.append(item.token_id)
                text = self.decode(ids)
                text = text[: sub.stop_strings.num_sendable(text)] if sub.stop_strings else text
                if text.startswith(sent) and len(text) > len(sent):
                    delta, sent = text[len(sent) :], text
                    yield chunk(delta)
            yield "data: [DONE]\n\n"
        finally:
            if not is_over:  # the client went away mid-stream
                self.service.cancel(sub.request_id, GONE)


def _extra(output: RequestOutput, run_id: int | None) -> dict[str, Any]:
    return {
        "request_id": output.request_id,
        "run_id": run_id,
        "class": output.request_class,
        "tag_counts": dict(output.tag_counts),
        "ttft_s": output.ttft_s,
        "tpot_s": output.tpot_s,
    }


def _joint_extra(extras: list[dict[str, Any]], route: Route) -> dict[str, Any]:
    """The ``fallbackgate`` object of a request with several prompts: each choice's ledger request in order."""
    return {"run_id": route.run_id, "class": route.request_class, "choices": extras}

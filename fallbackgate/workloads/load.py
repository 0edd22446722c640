"""A bounded, open-loop load generator for a workload file against an OpenAI-compatible server.

Each request is due at its ``arrival_s`` (times ``time_scale``) after the start; at most ``concurrency`` are
in flight, so a request due while all slots are taken waits for one (``late_s``: how long). Requests are
streamed completions (``POST /v1/completions``, ``"stream": true``) and every time is measured on the
client's monotonic clock from the request's arrival, not from when it was sent: TTFT is arrival to the first
chunk that carries text, latency arrival to the last chunk, TPOT the time between the first and the last
text chunk over the output tokens after the first. Output tokens are the server's ``usage`` when it sends one
(``stream_options.include_usage``), else the text chunks counted (``tokens_counted_from`` says which); the
server's own TTFT/TPOT (the ``fallbackgate`` object of its last chunk) are reported beside.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np

from fallbackgate.api_server.protocol import CLASS_HEADER
from fallbackgate.batch.prompts import PromptSpec

DEFAULT_MAX_TOKENS = 16  # for a request whose line names no max_new_tokens


@dataclasses.dataclass(slots=True)
class Sent:
    """One request's measured outcome (times in seconds)."""

    request_id: str  # the file's id
    arrival_s: float  # when it was due, from the start (scaled)
    late_s: float = 0.0  # sent this long after it was due (all slots were taken)
    status: int | None = None  # HTTP status (None: no response)
    error: str | None = None  # why it failed (None: it did not)
    ttft_s: float | None = None  # arrival to the first text chunk
    latency_s: float | None = None  # arrival to the last chunk
    tpot_s: float | None = None  # first to last text chunk, per output token after the first
    num_tokens: int = 0  # output tokens (usage, else text chunks)
    is_usage_counted: bool = False  # num_tokens came from the server's usage
    server_request_id: str | None = None  # the id the server gave it (its ledger id on fallbackgate serve)
    server_ttft_s: float | None = None  # the server's own measurement, from its last chunk
    server_tpot_s: float | None = None  # likewise


async def _one(client: httpx.AsyncClient, spec: PromptSpec, model: str, arrival: float, sent: Sent) -> None:
    body = {
        "model": model,
        "prompt": spec.prompt,
        "max_tokens": spec.max_new_tokens or DEFAULT_MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {CLASS_HEADER: spec.request_class} if spec.request_class != "default" else {}
    first = last = None
    num_chunks = 0
    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        sent.status = response.status_code
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            sent.error = f"HTTP {response.status_code}: {text[:200]}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                sent.error = str(chunk["error"].get("message", chunk["error"]))[:200]
                return
            now = time.monotonic()
            if any(c.get("text") for c in chunk.get("choices", ())):
                first = first if first is not None else now
                last, num_chunks = now, num_chunks + 1
            _take_extra(chunk, sent)
    end = time.monotonic()
    sent.latency_s = end - arrival
    sent.ttft_s = (first if first is not None else end) - arrival
    if not sent.is_usage_counted:
        sent.num_tokens = num_chunks
    if first is not None and last is not None and sent.num_tokens > 1:
        sent.tpot_s = (last - first) / (sent.num_tokens - 1)


def _take_extra(chunk: dict[str, Any], sent: Sent) -> None:
    usage = chunk.get("usage")
    if usage and usage.get("completion_tokens") is not None:
        sent.num_tokens, sent.is_usage_counted = int(usage["completion_tokens"]), True
    extra = chunk.get("fallbackgate")
    if extra:
        sent.server_ttft_s, sent.server_tpot_s = extra.get("ttft_s"), extra.get("tpot_s")
        sent.server_request_id = extra.get("request_id")


async def run_load(
    url: str,
    specs: Sequence[PromptSpec],
    *,
    model: str | None = None,
    concurrency: int = 8,
    time_scale: float = 1.0,
    timeout_s: float = 300.0,
) -> tuple[list[Sent], float]:
    """Send ``specs`` to the server at ``url`` (its ``/v1`` base) at their arrival times with at most
    ``concurrency`` in flight; returns each request's outcome (file order) and the wall seconds of the run."""
    slots = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url.rstrip("/"), timeout=timeout_s, limits=limits) as client:
        model = model or await _served_model(client)
        outcomes = [Sent(s.request_id, (s.arrival_s or 0.0) * time_scale) for s in specs]
        order = sorted(range(len(specs)), key=lambda i: outcomes[i].arrival_s)
        start = time.monotonic()

        async def send(i: int) -> None:
            arrival = start + outcomes[i].arrival_s
            async with slots:
                outcomes[i].late_s = max(0.0, time.monotonic() - arrival)
                try:
                    await _one(client, specs[i], model, arrival, outcomes[i])
                except (httpx.HTTPError, json.JSONDecodeError) as exc:
                    outcomes[i].error = f"{type(exc).__name__}: {exc}"[:200]

        tasks = []
        for i in order:
            await asyncio.sleep(max(0.0, start + outcomes[i].arrival_s - time.monotonic()))
            tasks.append(asyncio.create_task(send(i)))
        await asyncio.gather(*tasks)
        return outcomes, time.monotonic() - start


async def _served_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "mean": None, "max": None}
    array = np.asarray(values, dtype=np.float64)
    p50, p99 = np.percentile(array, [50, 99])
    return {"p50": float(p50), "p99": float(p99), "mean": float(array.mean()), "max": float(array.max())}


def _error_kind(sent: Sent) -> str:
    """ "http_<status>", "stream_error" (an error event after a 200) or the client exception's name."""
    if sent.status not in (None, 200):
        return f"http_{sent.status}"
    return "stream_error" if sent.status == 200 else (sent.error or "").split(":")[0]


def load_report(outcomes: list[Sent], wall_s: float, concurrency: int) -> dict[str, Any]:
    """TTFT/TPOT/latency percentiles, throughput and errors of a load run (JSON-ready)."""
    ok = [o for o in outcomes if o.error is None]
    num_tokens = sum(o.num_tokens for o in ok)
    errors = Counter(_error_kind(o) for o in outcomes if o.error is not None)
    counted = {"usage" if o.is_usage_counted else "chunks" for o in ok}
    return {
        "num_requests": len(outcomes),
        "num_ok": len(ok),
        "num_errors": len(outcomes) - len(ok),
        "errors": dict(errors),
        "first_errors": [o.error for o in outcomes if o.error][:5],
        "concurrency": concurrency,
        "wall_s": wall_s,
        "output_tokens": num_tokens,
        "throughput_tokens_per_s": num_tokens / wall_s if wall_s > 0 else None,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else None,
        "tokens_counted_from": sorted(counted),
        "ttft_s": _percentiles([o.ttft_s for o in ok if o.ttft_s is not None]),
        "tpot_s": _percentiles([o.tpot_s for o in ok if o.tpot_s is not None]),
        "latency_s": _percentiles([o.latency_s for o in ok if o.latency_s is not None]),
        "late_s": _percentiles([o.late_s for o in outcomes]),
        "server_ttft_s": _percentiles([o.server_ttft_s for o in ok if o.server_ttft_s is not None]),
        "server_tpot_s": _percentiles([o.server_tpot_s for o in ok if o.server_tpot_s is not None]),
    }

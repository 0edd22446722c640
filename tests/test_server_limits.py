"""``fallbackgate serve`` under hostile sizes and load, on 127.0.0.1: a body over the limit is refused with 413
before it is read (declared or chunked), a full admission queue answers 429 with ``Retry-After``, and a request
still running at shutdown is recorded as cancelled with what it had produced."""

from __future__ import annotations

import json
import pathlib
import socket
import threading
import time

import httpx
import pytest
from sqlalchemy import select

from fallbackgate.ledger.db import open_ledger
from fallbackgate.ledger.models import Request, Run
from tests.test_server import MODEL, Server

LIMIT_BYTES = 10_240  # --max-body-mb 0.009765625


def _raw(port: int, head: bytes, chunks: list[bytes]) -> tuple[bytes, float]:
    """Send `head` and `chunks` on a raw connection; the response's bytes and how long it took to come."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        started = time.monotonic()
        sock.sendall(head)
        for chunk in chunks:
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):  # the server answered and closed: fine
                break
        data = b""
        while not _is_complete(data):
            got = sock.recv(65536)
            if not got:
                break
            data += got
        return data, time.monotonic() - started


def _is_complete(data: bytes) -> bool:
    """Whether `data` holds a whole HTTP response with a Content-Length body."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory):
    ledger = str(tmp_path_factory.mktemp("limits") / "ledger.sqlite")
    srv = Server(ledger, "--max-body-mb", str(LIMIT_BYTES / 2**20), "--max-num-seqs", "1", "--max-queued", "1")
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


def test_a_declared_20_mb_body_gets_413_before_it_is_sent(limited: Server) -> None:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 20000000\r\n\r\n"
    )
    data, took = _raw(limited.port, head, [])  # not one byte of the body is sent: the server must not wait
    assert data.startswith(b"HTTP/1.1 413"), data[:200]
    body = json.loads(data.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "request_too_large" and "20000000 bytes" in body["error"]["message"]
    assert took < 5.0


def test_a_chunked_body_over_the_limit_gets_413_once_it_passes(limited: Server) -> None:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    piece = b'{"model": "checkpoint", "prompt": "' + b"a" * 4000
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece)] + [b"%x\r\n%s\r\n" % (4000, b"a" * 4000)] * 4
    data, _ = _raw(limited.port, head, chunks)  # 20 KB sent, never terminated: only the limit can end it
    assert data.startswith(b"HTTP/1.1 413"), data[:200]
    assert b"request_too_large" in data


def test_a_body_under_the_limit_is_served(limited: Server) -> None:
    reply = httpx.post(
        f"{limited.base}/v1/completions", json={"model": MODEL, "prompt": "Once upon", "max_tokens": 2}, timeout=60
    )
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2


def test_a_full_admission_queue_answers_429_with_retry_after(limited: Server) -> None:
    url = f"{limited.base}/v1/completions"
    long_body = {"model": MODEL, "prompt": "The king said", "max_tokens": 1000, "temperature": 0, "stream": True}
    queued: list[int] = []
    with httpx.Client(timeout=120) as client, client.stream("POST", url, json=long_body) as running:
        lines = running.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it runs: the one decode slot is taken
        waiter = threading.Thread(
            target=lambda: queued.append(
                httpx.post(url, json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=120).status_code
            )
        )
        waiter.start()
        deadline = time.monotonic() + 60
        while _in_flight(limited.base) < 2:  # the second request waits in the one queue place
            assert time.monotonic() < deadline, "the second request was not admitted"
            time.sleep(0.05)
        refused = httpx.post(url, json={"model": MODEL, "prompt": "Hello", "max_tokens": 2}, timeout=30)
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "too_many_requests"
        assert "--max-queued" in refused.json()["error"]["message"]
    # leaving the stream disconnects the long one: the server cancels it and the slot frees
    waiter.join(timeout=120)
    assert queued == [200]  # the queued one was served once the slot freed


def test_requests_still_running_at_shutdown_are_recorded_as_cancelled(tmp_path: pathlib.Path) -> None:
    ledger = str(tmp_path / "ledger.sqlite")
    srv = Server(ledger, "--grace-s", "1", "--max-num-seqs", "1")  # one at a time: the others wait their turn
    url = f"{srv.base}/v1/completions"
    received: list[str] = []

    def stream(index: int) -> None:
        body = {"model": MODEL, "prompt": f"Story {index}: once upon a time", "max_tokens": 200, "stream": True}
        body |= {"temperature": 0.8, "seed": index}
        try:
            with httpx.stream("POST", url, json=body, timeout=120) as reply:
                received.extend(reply.iter_lines())
        except httpx.HTTPError:
            pass  # the server went away mid-stream

    clients = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for client in clients:
        client.start()
    deadline = time.monotonic() + 60
    while not any(line.startswith("data: ") for line in received) and time.monotonic() < deadline:
        time.sleep(0.05)
    while _in_flight(srv.base) < 4 and time.monotonic() < deadline:  # every request admitted, not only sent
        time.sleep(0.05)
    out = srv.stop()
    for client in clients:
        client.join(timeout=60)
    with open_ledger(ledger) as opened, opened.engine.connect() as conn:
        rows = conn.execute(select(Request.status, Request.num_output_tokens, Request.token_ids)).all()
        status = conn.execute(select(Run.status)).scalar_one()
    cancelled = [r for r in rows if r.status == "cancelled"]
    assert srv.proc.returncode == 0 and f"{len(cancelled)} recorded as cancelled" in out, out
    assert len(rows) == 4 and {r.status for r in rows} <= {"finished", "cancelled"}, rows  # every request has a row
    assert cancelled and all(r.num_output_tokens < 200 for r in cancelled)  # what each had produced by then
    assert all(len(r.token_ids) > r.num_output_tokens for r in cancelled)  # its prompt, then its output so far
    assert status == "incomplete"


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory):
    ledger = str(tmp_path_factory.mktemp("guarded") / "ledger.sqlite")
    srv = Server(ledger, "--api-key", "sesame", "--request-timeout-s", "3", "--audit-workers", "0")
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


def _auth(key: str = "sesame") -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _metric(srv: Server, name: str) -> float:
    text = httpx.get(f"{srv.base}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_api_key_is_required_on_v1_routes(guarded: Server) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    for headers in ({}, _auth("wrong")):
        reply = httpx.post(f"{guarded.base}/v1/completions", json=body, headers=headers, timeout=30)
        assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key", reply.text
    assert httpx.get(f"{guarded.base}/v1/models", timeout=30).status_code == 401
    assert httpx.get(f"{guarded.base}/health", timeout=30).status_code == 200  # probes stay open
    served = guarded.client().with_options(api_key="sesame").completions.create(**body)
    assert served.usage.completion_tokens == 2


def test_a_request_past_its_time_limit_ends_with_504(guarded: Server) -> None:
    url = f"{guarded.base}/v1/completions"
    started = time.monotonic()
    body = {"model": MODEL, "prompt": "The king said", "max_tokens": 1000, "temperature": 0}
    reply = httpx.post(url, json=body, headers=_auth(), timeout=120)
    assert reply.status_code == 504 and reply.json()["error"]["code"] == "timeout", reply.text
    assert 3.0 <= time.monotonic() - started < 30
    asked = body | {"max_tokens": 1000, "fallbackgate": {"timeout_s": 0.5}}  # the body's own, shorter limit
    started = time.monotonic()
    assert httpx.post(url, json=asked, headers=_auth(), timeout=120).status_code == 504
    assert time.monotonic() - started < 3.0


def test_a_client_that_disconnects_ends_its_request_in_the_engine(guarded: Server) -> None:
    url = f"{guarded.base}/v1/completions"
    before = _metric(guarded, 'fallbackgate_requests_total{outcome="cancelled"')
    stream = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1000, "stream": True}
    with httpx.stream("POST", url, json=stream, headers=_auth(), timeout=60) as reply:
        assert next(line for line in reply.iter_lines() if line.startswith("data: "))
    try:  # the whole-response kind: the client gives up after 0.5 s
        httpx.post(url, json=stream | {"stream": False}, headers=_auth(), timeout=0.5)
    except httpx.TimeoutException:
        pass
    deadline = time.monotonic() + 10
    while _metric(guarded, 'fallbackgate_requests_total{outcome="cancelled"') < before + 2:
        assert time.monotonic() < deadline, "the disconnected requests were not cancelled"
        time.sleep(0.1)
    assert _metric(guarded, "fallbackgate_requests_in_flight") == 0  # both left the engine, well before 3 s


def _in_flight(base: str) -> float:
    """The server's own count of admitted, unfinished requests (its /metrics gauge)."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    lines = [line for line in text.splitlines() if line.startswith("fallbackgate_requests_in_flight ")]
    return float(lines[0].split()[1]) if lines else 0.0

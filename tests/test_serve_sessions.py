"""A served request's session reaches the engine: the prefix blocks a chat turn leaves behind are kept as its
session's (so the joint controller keeps a copy for the next turn), from the body or the header; a bad id is a
400 that loses nothing."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from fallbackgate.api_server.app import build_app
from fallbackgate.api_server.metrics import ServerMetrics
from fallbackgate.api_server.routing import ServerInfo
from fallbackgate.api_server.service import EngineService
from fallbackgate.bench.prefix_reuse import make_engine
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.kv.prefix_cache import PREFIX_ID

MODEL = "tinymoe"
CHAT = [{"role": "user", "content": "Tell me about the old king and the river that ran past his castle walls."}]


@pytest.fixture
def served(tmp_path: pathlib.Path) -> Iterator[tuple[TestClient, Engine]]:
    engine = make_engine(str(tmp_path), True)
    service = EngineService(engine, None, ServerMetrics(), classes=("default",), slos={}, audit_rate=0.0)
    app = build_app(service, ServerInfo(MODEL, None, "default", lambda: service.drain(5.0)))
    with TestClient(app) as client:
        yield client, engine
    engine.close()


def _kept_sessions(engine: Engine) -> list[bool]:
    infos = [engine.prefix.entry_info(rid) for rid in engine.kv_store.tables if rid.startswith(PREFIX_ID)]
    return [info.is_session for info in infos if info is not None]


def _chat(client: TestClient, **extra: object) -> dict:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, "temperature": 0} | extra
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.mark.parametrize("how", ["body", "header"])
def test_a_turn_with_a_session_leaves_its_blocks_kept_as_the_sessions(
    served: tuple[TestClient, Engine], how: str
) -> None:
    client, engine = served
    if how == "body":
        _chat(client, fallbackgate={"session": "chat-42"})
    else:
        body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, "temperature": 0}
        reply = client.post("/v1/chat/completions", json=body, headers={"X-Fallbackgate-Session": "chat-42"})
        assert reply.status_code == 200, reply.text
    kept = _kept_sessions(engine)
    assert kept and all(kept), kept  # every full block of the turn, each marked as the session's


def test_a_turn_without_a_session_leaves_plain_kept_blocks(served: tuple[TestClient, Engine]) -> None:
    client, engine = served
    _chat(client)
    kept = _kept_sessions(engine)
    assert kept and not any(kept), kept


@pytest.mark.parametrize("session", ["", "x" * 257, 7])
def test_a_bad_session_id_is_a_400_naming_the_field(served: tuple[TestClient, Engine], session: object) -> None:
    client, engine = served
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, "fallbackgate": {"session": session}}
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400, reply.text
    assert "session" in reply.text
    assert engine.num_added == 0  # nothing reached the engine
    assert _chat(client)["usage"]["completion_tokens"] == 4  # and the server still serves


def test_the_header_is_checked_and_the_body_wins(served: tuple[TestClient, Engine]) -> None:
    client, engine = served
    body = {"model": MODEL, "prompt": "The king said", "max_tokens": 2, "temperature": 0}
    reply = client.post("/v1/completions", json=body, headers={"X-Fallbackgate-Session": "x" * 257})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "X-Fallbackgate-Session", reply.text
    assert engine.num_added == 0
    empty = client.post("/v1/completions", json=body, headers={"X-Fallbackgate-Session": ""})
    assert empty.status_code == 200, empty.text  # an empty header names no session
    assert not any(_kept_sessions(engine))
    long_prompts = [CHAT[0]["content"] * 2, "The river ran past the castle walls. " * 6]
    both = body | {"fallbackgate": {"session": "from-body"}, "prompt": long_prompts}
    reply = client.post("/v1/completions", json=both, headers={"X-Fallbackgate-Session": "x" * 300})
    assert reply.status_code == 200, reply.text  # the body's session is used; the header is not read
    assert len(reply.json()["choices"]) == 2
    kept = _kept_sessions(engine)
    assert len(kept) >= 2 and all(kept), kept  # both prompts' full blocks, kept as the session's

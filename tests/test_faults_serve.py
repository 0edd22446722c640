"""``fallbackgate serve`` keeps serving while one expert of its (copied, bundled) checkpoint goes bad mid-run:
the requests that need it get an OpenAI-shaped error (an SSE error event when streamed), every other request
gets 200 and the same text as before the fault, and /health and /metrics name the quarantined expert."""

from __future__ import annotations

import json

import httpx
import pytest

from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.engine import Engine
from tests.test_faults_local import LAYER, POLICY, copy_bundled, some_not_all
from tests.test_faults_run import TEXTS as RUN_TEXTS
from tests.test_faults_run import routed_experts
from tests.test_server import Server

TEXTS = [*RUN_TEXTS, "The little bird flew over the river"]
NEW_TOKENS = 6
MODEL = "bundled"  # the copied checkpoint's directory name, as /v1/models lists it


def overwrite_file_bytes(path, key: tuple[int, int]) -> None:
    """Overwrite bytes inside every tensor of expert `key` in the checkpoint copy at `path`."""
    probe = Engine(EngineConfig(model_dir=str(path), host_budget_bytes=0), ExactLRUController())
    reader = probe.expert_store.reader
    spans = [reader.files.byte_range(name, index) for name, index in reader.sources[key].parts]
    probe.close()
    for file, offset, num_bytes in spans:
        with open(file, "r+b") as handle:
            handle.seek(offset + num_bytes // 2)
            handle.write(b"\xa5" * 64)


def complete(base: str, text: str, **extra) -> httpx.Response:
    body = {"model": MODEL, "prompt": text, "max_tokens": NEW_TOKENS, "temperature": 0, **extra}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=120)


@pytest.fixture()
def bad_expert_server(tmp_path):
    path = copy_bundled(tmp_path)
    routed = routed_experts(path, TEXTS, NEW_TOKENS)
    expert = some_not_all(routed)
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    srv = Server(str(tmp_path / "ledger.sqlite"), "--model", str(path), "--device-budget-mb", "3",
                 "--audit-workers", "0", policy=policy)  # fmt: skip
    yield srv, path, routed, expert
    if srv.proc.poll() is None:
        srv.stop()


@pytest.mark.slow
def test_one_bad_expert_fails_only_the_requests_that_need_it(bad_expert_server) -> None:
    srv, path, routed, expert = bad_expert_server
    users = [int(rid[1:]) for rid, experts in routed.items() if expert in experts]
    others = [i for i in range(len(TEXTS)) if i not in users]
    before = {i: complete(srv.base, TEXTS[i]) for i in others}  # served from a sound checkpoint
    assert all(r.status_code == 200 for r in before.values()), [r.text for r in before.values()]
    overwrite_file_bytes(path, (LAYER, expert))  # mid-run: the disk goes bad under one expert
    failed = complete(srv.base, TEXTS[users[0]])
    assert failed.status_code == 500
    error = failed.json()["error"]
    assert error["code"] == "expert_quarantined" and error["type"] == "server_error"
    assert f"quarantined: expert {LAYER}:{expert}" in error["message"]
    after = {i: complete(srv.base, TEXTS[i]) for i in others}  # the same layer's other experts: served
    assert all(r.status_code == 200 for r in after.values())
    assert {i: r.json()["choices"][0]["text"] for i, r in after.items()} == {
        i: r.json()["choices"][0]["text"] for i, r in before.items()
    }
    streamed = complete(srv.base, TEXTS[users[-1]], stream=True)
    if streamed.status_code == 200:  # the stream had started: its error comes as an event
        events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
        assert events[-1]["error"]["code"] == "expert_quarantined"
    else:
        assert streamed.status_code == 500 and streamed.json()["error"]["code"] == "expert_quarantined"
    health = httpx.get(f"{srv.base}/health", timeout=10).json()
    assert health["status"] == "ok"
    (record,) = health["quarantined"]
    assert record["object_id"] == f"{LAYER}:{expert}" and record["found"] != record["expected"]
    metrics = httpx.get(f"{srv.base}/metrics", timeout=30).text
    assert "fallbackgate_quarantined_objects 1.0" in metrics
    assert f'fallbackgate_quarantined{{object_id="{LAYER}:{expert}",object_kind="expert"}} 1.0' in metrics
    assert 'outcome="failed"' in metrics

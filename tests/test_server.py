"""``fallbackgate serve`` with the official openai client against a live server on 127.0.0.1.

The server runs as a subprocess on the bundled model with the shipped two-class policy and a SQLite ledger;
everything is checked through HTTP and then through the ledger after a SIGTERM shutdown.
"""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from fallbackgate.ledger import queries
from fallbackgate.ledger.db import open_ledger
from fallbackgate.policy import loader
from tests.pg_fixture import free_port, pg_server_fixture, pg_url_fixture  # noqa: F401 - fixtures
from tests.test_dashboard import open_page

POLICY = pathlib.Path(loader.__file__).parents[1] / "policies" / "two_classes.yaml"
MODEL = "checkpoint"  # the bundled model's directory name, as /v1/models lists it


class Server:
    """A `fallbackgate serve` subprocess."""

    def __init__(self, ledger: str, *extra: str, policy: pathlib.Path = POLICY) -> None:
        self.port = free_port()
        self.ledger = ledger
        cmd = [sys.executable, "-m", "fallbackgate", "serve", "--policy", str(policy), "--port", str(self.port)]
        cmd += ["--ledger", ledger, "--grace-s", "20", *extra]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(self.proc.stdout.read().decode())
            try:
                if httpx.get(f"{self.base}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise AssertionError("server did not come up")

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key="unused", max_retries=0, **kwargs)

    def stop(self, sig: int = signal.SIGTERM) -> str:
        self.proc.send_signal(sig)
        out, _ = self.proc.communicate(timeout=120)
        return out.decode()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    ledger = str(tmp_path_factory.mktemp("serve") / "ledger.sqlite")
    srv = Server(ledger)
    yield srv
    if srv.proc.poll() is None:
        srv.stop()


def test_completion_chat_and_models(server: Server) -> None:
    client = server.client()
    assert [m.id for m in client.models.list()] == [MODEL]  # the policy's default class is strict
    done = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert done.usage.completion_tokens == 8 and done.choices[0].finish_reason == "length"
    extra = done.model_extra["fallbackgate"]
    assert extra["request_id"] == done.id and extra["class"] == "strict" and sum(extra["tag_counts"].values()) > 0
    again = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert again.choices[0].text == done.choices[0].text  # greedy: the same text
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=6, temperature=0
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 6


def test_streaming_matches_the_whole_response(server: Server) -> None:
    client = server.client()
    messages = [{"role": "user", "content": "The king said"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].model_extra["fallbackgate"]["request_id"]
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(model=MODEL, prompt="A", max_tokens=5, temperature=0, stream=True)
    )
    assert text == client.completions.create(model=MODEL, prompt="A", max_tokens=5, temperature=0).choices[0].text


def test_class_from_body_or_header(server: Server) -> None:
    client = server.client()
    body = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=3, extra_body={"fallbackgate": {"class": "strict"}}
    )
    assert body.model_extra["fallbackgate"]["class"] == "strict"
    header = server.client(default_headers={"X-Fallbackgate-Class": "strict"})
    assert (
        header.completions.create(model=MODEL, prompt="Hi", max_tokens=3).model_extra["fallbackgate"]["class"]
        == "strict"
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "needle"),
    [
        (
            {"extra_body": {"fallbackgate": {"class": "gold"}}},
            openai.BadRequestError,
            "classes are: best-effort, strict",
        ),
        ({"max_tokens": 0}, openai.BadRequestError, "max_tokens"),
        ({"temperature": -1}, openai.BadRequestError, "temperature"),
        ({"n": 2}, openai.BadRequestError, "n"),
        ({"extra_body": {"frobnicate": 1}}, openai.BadRequestError, "frobnicate"),
        ({"model": "gpt-4"}, openai.NotFoundError, "not served here"),
    ],
)
def test_bad_requests_are_openai_errors(server: Server, kwargs: dict, error: type, needle: str) -> None:
    args = {"model": MODEL, "prompt": "Hello", "max_tokens": 3} | kwargs
    with pytest.raises(error) as info:
        server.client().completions.create(**args)
    assert needle in info.value.body["message"], info.value.body
    assert info.value.body["type"] == "invalid_request_error"


def test_metrics(server: Server) -> None:
    server.client().completions.create(model=MODEL, prompt="Metrics", max_tokens=4)
    text = httpx.get(f"{server.base}/metrics").text
    for name in (
        'fallbackgate_requests_total{outcome="ok",request_class="strict"}',
        "fallbackgate_ttft_seconds_bucket",
        "fallbackgate_tpot_seconds_bucket",
        'fallbackgate_objects_total{kind="expert"',
        "fallbackgate_expert_hit_ratio",
        'fallbackgate_pool_bytes{kind="expert",pool="device"}',
        "fallbackgate_queue_depth",
        "fallbackgate_requests_in_flight",
        "fallbackgate_slo_attainment",
    ):
        assert name in text, name


def _load(server: Server, num_requests: int, num_clients: int) -> list[float]:
    client = server.client(timeout=300)

    def one(i: int) -> float:
        cls = ("strict", "best-effort")[i % 2]
        started = time.perf_counter()
        out = client.completions.create(
            model=MODEL,
            prompt=f"Request {i}: once upon a time",
            max_tokens=4 + i % 5,
            temperature=0,
            extra_body={"fallbackgate": {"class": cls}},
        )
        assert out.usage.completion_tokens == 4 + i % 5 and out.model_extra["fallbackgate"]["class"] == cls
        return time.perf_counter() - started

    with concurrent.futures.ThreadPoolExecutor(num_clients) as pool:
        return list(pool.map(one, range(num_requests)))


def _percentiles(latencies: list[float]) -> str:
    q = statistics.quantiles(latencies, n=100)
    return f"p50 {1e3 * q[49]:.0f} ms, p99 {1e3 * q[98]:.0f} ms over {len(latencies)} requests"


def test_concurrent_load_then_sigterm_leaves_every_request_in_the_ledger(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = str(tmp_path / "load.sqlite")
    srv = Server(ledger)
    latencies = _load(srv, 48, 16)
    print("serve latency:", _percentiles(latencies))
    deadline = time.monotonic() + 60  # the background worker audits while the server idles
    while "fallbackgate_audited_kl_nats_count" not in (text := httpx.get(f"{srv.base}/metrics").text):
        assert time.monotonic() < deadline, "no audit reached /metrics"
        time.sleep(0.5)
    assert 'statistic="max"' in text
    out = srv.stop()
    # SIGTERM is how a server is told to stop: after a clean drain it exits 0
    assert srv.proc.returncode == 0 and "0 request(s) interrupted" in out and "Traceback" not in out, out
    with open_ledger(ledger) as led:
        (run,) = queries.list_runs(led)
        assert run["status"] == "complete"
        requests = queries.request_summaries(led, run["id"])
        tags = queries.request_tags(led, run["id"])
        steps = queries.run_tag_counts(led, run["id"])
    assert len(requests) == 48 and all(sum(tags[r["request_id"]].values()) > 0 for r in requests)
    assert {r["request_class"] for r in requests} == {"strict", "best-effort"} and steps
    at = open_page(pathlib.Path(ledger), "overview", monkeypatch)  # the dashboard shows it like any run
    shown = {m.label: m.value for m in at.metric}
    assert shown["Runs"] == "1" and shown["Requests"] == "48", shown


@pytest.mark.slow
def test_load_of_200_requests_with_audits_on_and_off(tmp_path: pathlib.Path) -> None:
    for workers in ("0", "1"):
        ledger = str(tmp_path / f"audit-workers-{workers}.sqlite")
        srv = Server(ledger, "--audit-workers", workers)
        latencies = _load(srv, 200, 16)
        print(f"serve latency, {workers} background audit worker(s):", _percentiles(latencies))
        out = srv.stop()
        assert "0 request(s) interrupted" in out and "Traceback" not in out, out
        with open_ledger(ledger) as led:
            (run,) = queries.list_runs(led)
            requests = queries.request_summaries(led, run["id"])
            tags = queries.request_tags(led, run["id"])
            verdicts = queries.verdicts(led, run["id"])
        assert run["status"] == "complete" and len(requests) == 200, run
        assert all(sum(tags[r["request_id"]].values()) > 0 for r in requests)
        if workers == "1":  # the worker audited the sample and judged the run once serving stopped
            assert any(v["request_id"] is None for v in verdicts), verdicts
            assert sum(r["num_positions"] is not None for r in requests) >= 1


@pytest.mark.slow
def test_sigkill_mid_load_leaves_a_consistent_ledger(tmp_path: pathlib.Path) -> None:
    import sqlite3

    ledger = tmp_path / "kill.sqlite"
    srv = Server(str(ledger), "--audit-workers", "0")
    client = srv.client(timeout=60)
    finished: list[str] = []

    def one(i: int) -> None:
        try:
            finished.append(client.completions.create(model=MODEL, prompt=f"Request {i}", max_tokens=12).id)
        except openai.APIError:
            pass

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(one, i) for i in range(200)]
        while len(finished) < 40:
            time.sleep(0.05)
        srv.proc.kill()
        srv.proc.wait(timeout=30)
        concurrent.futures.wait(futures)
    con = sqlite3.connect(ledger)
    assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    assert con.execute("SELECT status FROM runs").fetchall() == [("running",)]
    recorded = {r for (r,) in con.execute("SELECT request_id FROM requests")}
    assert recorded  # requests the writer committed before the kill (the last flush interval may be lost)
    missing = con.execute(
        "SELECT count(*) FROM requests r WHERE NOT EXISTS (SELECT 1 FROM step_requests s WHERE s.run_id = r.run_id "
        "AND s.request_id = r.request_id)"
    ).fetchone()
    assert missing == (0,)  # a recorded request's step rows (its resident uses are counts there) come first
    with open_ledger(str(ledger)) as led:
        assert queries.list_runs(led)[0]["status"] == "incomplete"


@pytest.mark.slow
def test_two_servers_share_one_postgresql_ledger(pg_url: str) -> None:
    servers = [Server(pg_url, "--audit-workers", "0") for _ in range(2)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        latencies = list(pool.map(lambda s: _load(s, 60, 8), servers))
    for srv, lat in zip(servers, latencies, strict=True):
        print("serve latency (one of two servers):", _percentiles(lat))
        assert "Traceback" not in srv.stop()
    with open_ledger(pg_url) as led:
        runs = queries.list_runs(led)
        assert len(runs) == 2 and {r["status"] for r in runs} == {"complete"}
        for run in runs:
            requests = queries.request_summaries(led, run["id"])
            tags = queries.request_tags(led, run["id"])
            assert len(requests) == 60 and all(sum(tags[r["request_id"]].values()) > 0 for r in requests)

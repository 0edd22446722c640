"""Arrival times honoured: ``run`` submits each request when the wall clock since its start reaches the
request's ``arrival_s`` (idling meanwhile, TTFT from the arrival), and ``fallbackgate load`` sends a workload
file to a real ``serve`` on 127.0.0.1 at its arrival times with bounded concurrency."""

from __future__ import annotations

import json
import pathlib
import time

import pytest
from sqlalchemy import select

from fallbackgate.batch.prompts import PromptSpec
from fallbackgate.batch.session import RunSettings, run_prompts
from fallbackgate.cli import main
from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.engine import Engine
from fallbackgate.ledger.db import open_ledger
from fallbackgate.ledger.models import Request


@pytest.fixture(name="engine", scope="module")
def engine_fixture(checkpoint_factory) -> Engine:
    built = Engine(EngineConfig(model_dir=str(checkpoint_factory("qwen3_moe")), block_size=4), ExactLRUController())
    warm = [PromptSpec("Warm up the experts", "warm", max_new_tokens=2)]  # the first steps read every expert
    run_prompts(built, warm, RunSettings(model_dir=built.config.model_dir), None, False)
    yield built
    built.close()


def _submissions(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, str]]:
    """(perf_counter, request id) of every add_request, as the engine sees them."""
    added: list[tuple[float, str]] = []
    real = engine.add_request

    def add(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        added.append((time.perf_counter(), args[2]))
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "add_request", add)
    return added


class FakeClock:
    """The session's clock: sleeping advances it, and so does every engine step (by STEP_S)."""

    STEP_S = 0.05

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept_until: list[float] = []  # the clock after each sleep

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds
        self.slept_until.append(self.now)

    def process_time(self) -> float:
        return time.process_time()


def test_requests_are_submitted_when_due_and_the_engine_idles_until_then(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fallbackgate.batch import session

    clock = FakeClock()
    monkeypatch.setattr(session, "time", clock)
    real_step = engine.step

    def step():  # noqa: ANN202
        clock.now += clock.STEP_S
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    added = _submissions(engine, monkeypatch)
    monkeypatch.setattr(time, "perf_counter", clock.perf_counter)  # what _submissions stamps
    specs = [  # file order is not arrival order; one line has no arrival (at once)
        PromptSpec("The third one", "c", max_new_tokens=2, arrival_s=0.8),
        PromptSpec("The first one", "a", max_new_tokens=2, arrival_s=0.0),
        PromptSpec("At once", "now", max_new_tokens=2),
        PromptSpec("The second one", "b", max_new_tokens=2, arrival_s=0.42),
    ]
    start = clock.now
    outcome = run_prompts(engine, specs, RunSettings(model_dir=engine.config.model_dir), None, False)
    monkeypatch.undo()
    assert [o.request_id for o in outcome.outputs] == ["c", "a", "now", "b"]  # prompt order
    assert [rid for _, rid in added] == ["a", "now", "b", "c"]  # arrival order, stable for equal arrivals
    assert [round(when - start, 9) for when, _ in added] == [0.0, 0.0, 0.42, 0.8]  # each when due, on an idle engine
    for rid, due in (("a", 0.0), ("now", 0.0), ("b", 0.42), ("c", 0.8)):
        output = next(o for o in outcome.outputs if o.request_id == rid)
        assert output.arrival_s - start == pytest.approx(due, abs=1e-9)  # what TTFT counts from
    # the engine slept until each arrival (nothing ran then), and stepped only with work
    assert [round(t - start, 9) for t in clock.slept_until] == [0.42, 0.8]
    assert len(outcome.steps) == 6  # a prefill and a decode step per arrival (a and "now" share theirs)
    assert outcome.wall_s == pytest.approx(0.8 + 2 * clock.STEP_S, abs=1e-9)


def test_real_delays_are_honoured(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    specs = [PromptSpec(f"Request {i}", f"r{i}", max_new_tokens=2, arrival_s=0.3 * i) for i in (2, 0, 1)]
    added = _submissions(engine, monkeypatch)
    outcome = run_prompts(engine, specs, RunSettings(model_dir=engine.config.model_dir), None, False)
    start = min(o.arrival_s for o in outcome.outputs)
    assert [rid for _, rid in added] == ["r0", "r1", "r2"]
    for (when, rid), due in zip(added, (0.0, 0.3, 0.6), strict=True):
        output = next(o for o in outcome.outputs if o.request_id == rid)
        assert output.arrival_s - start == pytest.approx(due, abs=1e-9)
        assert when - start >= due  # never before it is due
        assert output.first_token_s > output.arrival_s
    assert outcome.wall_s >= 0.6


def test_a_request_arriving_during_a_step_waits_on_its_own_clock(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    specs = [
        PromptSpec("A long step first", "first", max_new_tokens=2, arrival_s=0.0),
        PromptSpec("Arrives mid-step", "mid", max_new_tokens=2, arrival_s=0.1),
    ]
    real_step, calls = engine.step, []

    def slow_first_step():  # noqa: ANN202
        calls.append(1)
        if len(calls) == 1:
            time.sleep(0.4)
        return real_step()

    monkeypatch.setattr(engine, "step", slow_first_step)
    added = _submissions(engine, monkeypatch)
    outcome = run_prompts(engine, specs, RunSettings(model_dir=engine.config.model_dir), None, False)
    first, mid = outcome.outputs
    assert mid.arrival_s - first.arrival_s == pytest.approx(0.1, abs=1e-9)
    assert added[1][0] - first.arrival_s >= 0.4  # it could only be submitted after the step
    assert mid.ttft_s >= 0.3  # and the wait counts in its TTFT


def test_load_generator_against_a_real_server(tmp_path: pathlib.Path) -> None:
    from tests.test_server import Server

    spaced = [{"id": f"r{i}", "prompt": f"Request {i}", "max_new_tokens": 4, "arrival_s": 1.0 * i} for i in range(3)]
    burst = [{"id": f"b{i}", "prompt": f"Burst {i}", "max_new_tokens": 4, "arrival_s": 0.0} for i in range(4)]
    ledger = tmp_path / "load.sqlite"
    srv = Server(str(ledger), "--audit-workers", "0")
    reports = {}
    try:
        for name, lines, concurrency in (("spaced", spaced, "4"), ("burst", burst, "1")):
            workload = tmp_path / f"{name}.jsonl"
            workload.write_text("".join(json.dumps(line) + "\n" for line in lines))
            out = tmp_path / f"{name}.json"
            args = ["load", str(workload), "--url", f"{srv.base}/v1", "--concurrency", concurrency, "--json", str(out)]
            assert main(args) == 0
            reports[name] = json.loads(out.read_text())
    finally:
        log = srv.stop()
    assert "Traceback" not in log, log
    for name, report in reports.items():
        num = len(spaced if name == "spaced" else burst)
        assert report["num_ok"] == num and report["num_errors"] == 0 and report["errors"] == {}, report
        for key in ("ttft_s", "tpot_s", "latency_s"):
            assert 0 < report[key]["p50"] <= report[key]["p99"] < 60, (key, report[key])
        assert report["output_tokens"] == 4 * num and report["throughput_tokens_per_s"] > 0
        assert report["tokens_counted_from"] == ["chunks"]  # the server sends no usage in streams yet
        assert all(r["server_ttft_s"] is not None for r in report["requests"])
    by_id = {r["request_id"]: r for r in reports["spaced"]["requests"]}
    assert reports["spaced"]["wall_s"] >= 2.0
    assert all(by_id[f"r{i}"]["late_s"] < 0.2 for i in range(3))  # free slots: each went out when due
    waited = sorted(reports["burst"]["requests"], key=lambda r: r["late_s"])
    for before, after in zip(waited, waited[1:], strict=False):  # one in flight: each waited for the one before
        assert after["late_s"] >= before["latency_s"] - 0.01, (before, after)
        assert after["ttft_s"] >= after["late_s"]  # TTFT counts from the arrival, waiting included
    with open_ledger(str(ledger)) as led, led.engine.connect() as conn:
        recorded = list(conn.execute(select(Request.request_id).order_by(Request.id)).scalars())
    assert recorded[:3] == [by_id[f"r{i}"]["server_request_id"] for i in range(3)]  # finished in arrival order
    assert len(recorded) == 7


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--concurrency", "0"], "--concurrency must be 1..4096"),
        (["--time-scale", "-1"], "--time-scale must be"),
        (["--url", "127.0.0.1:8000"], "--url must be an http(s) URL"),
        (["--url", "http://127.0.0.1:{port}/v1"], "did not answer as a server should"),
    ],
)
def test_load_bad_input_exits_2(tmp_path: pathlib.Path, capsys, extra: list[str], needle: str) -> None:
    from tests.pg_fixture import free_port

    workload = tmp_path / "w.jsonl"
    workload.write_text(json.dumps({"prompt": "Hi", "arrival_s": 0.0}) + "\n")
    extra = [e.format(port=free_port()) for e in extra]
    assert main(["load", str(workload), *extra]) == 2
    assert needle in capsys.readouterr().err
    assert main(["load", str(tmp_path / "missing.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err

"""What the trace-cost benchmark accounts: the sink thread's CPU (only jobs it runs itself), the serving
loop's full collections (generation 2 only), and the hardware profile's record built once per profile."""

from __future__ import annotations

import dataclasses
import gc
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import func, select

from fallbackgate.assembly import Overrides, assemble, no_policy
from fallbackgate.bench.trace_overhead import FullCollections, _side
from fallbackgate.engine import hardware
from fallbackgate.engine.hardware import CPU_BOX, PCIE4_GPU_NVME, profile_record
from fallbackgate.ledger.db import open_ledger
from fallbackgate.ledger.models_runs import Request, Run
from fallbackgate.tracing import TraceTable, TraceWriter, read_trace
from fallbackgate.tracing.live import LiveTracer
from fallbackgate.tracing.sink import ParquetSink


def test_sink_counts_cpu_of_jobs_on_its_own_thread_only(tmp_path: Path) -> None:
    sink = ParquetSink(tmp_path)
    ran_on: list[str] = []
    burn = threading.Event()

    def job() -> None:
        ran_on.append(threading.current_thread().name)
        total = 0
        for i in range(300_000):  # CPU work the sink's clock must see
            total += i * i
        burn.set()

    sink._put(job)
    assert burn.wait(10)
    sink.drain()
    on_thread = sink.spent_cpu_ns
    assert ran_on == [f"trace-sink {tmp_path.name}"] and on_thread > 1_000_000  # > 1 ms of CPU
    sink.stop_thread()
    sink._put(job)  # run by close() on this thread: the caller's time, not the sink's
    sink.close()
    assert ran_on[-1] == threading.current_thread().name
    assert sink.spent_cpu_ns == on_thread


def test_writer_reports_its_sinks_cpu(tmp_path: Path) -> None:
    rows = 200_000  # one row group big enough that converting and writing it takes the sink's thread measurable CPU
    with TraceWriter(tmp_path / "t", {}, row_group_rows=rows) as writer:
        assert writer.sink_cpu_ns < 50_000_000  # opening the files only
        opened = writer.sink_cpu_ns
        writer.append(TraceTable.STEPS, step=np.arange(rows), phase=np.zeros(rows, dtype=np.int64),
                      start_ns=np.arange(rows), end_ns=np.arange(rows) + 1, batch=np.ones(rows, dtype=np.int64),
                      tokens=np.ones(rows, dtype=np.int64))  # fmt: skip
        deadline = time.monotonic() + 30
        while writer.sink_cpu_ns == opened and time.monotonic() < deadline:  # the sink's thread takes the group
            time.sleep(0.01)
        writer.flush()
        assert writer.sink_cpu_ns > opened
        assert writer.sink_cpu_ns == writer._sink.spent_cpu_ns


def test_tracer_counts_its_own_construction(tmp_path: Path) -> None:
    built = assemble(no_policy(), Overrides(max_new_tokens=2))
    try:
        tracer = LiveTracer(tmp_path / "t", built.engine, {})
        assert tracer.spent_ns > 0 and tracer.spent_cpu_ns >= 0
        made = tracer.spent_ns
        tracer.close()
        assert tracer.spent_ns > made  # closing counted on top
    finally:
        built.engine.close()


def test_full_collections_counts_generation_two_only() -> None:
    gc.collect()
    with FullCollections() as collections:
        gc.collect(0)
        gc.collect(1)
        assert collections.wall_s == []
        gc.collect()
        gc.collect(2)
    assert len(collections.wall_s) == 2 and len(collections.cpu_s) == 2
    assert all(s >= 0 for s in collections.wall_s + collections.cpu_s)
    gc.collect()
    assert len(collections.wall_s) == 2  # the callback left with the block
    assert collections._on_gc not in gc.callbacks


def test_profile_record_is_asdict_built_once_per_profile() -> None:
    record = profile_record(CPU_BOX)
    assert record == dataclasses.asdict(CPU_BOX)
    assert profile_record(CPU_BOX) is record
    other = profile_record(PCIE4_GPU_NVME)
    assert other == dataclasses.asdict(PCIE4_GPU_NVME) and other is not record
    copy = dataclasses.replace(CPU_BOX, name="cpu-box-copy")
    assert profile_record(copy)["name"] == "cpu-box-copy"


def test_profile_records_stay_bounded() -> None:
    profiles = [dataclasses.replace(CPU_BOX, name=f"p{i}") for i in range(hardware._MAX_RECORDS + 4)]
    records = [profile_record(p) for p in profiles]
    assert [r["name"] for r in records] == [p.name for p in profiles]
    assert len(hardware._RECORDS) <= hardware._MAX_RECORDS


def test_benchmark_sides_record_requests_and_account_the_trace(tmp_path: Path) -> None:
    built = assemble(no_policy(), Overrides(max_new_tokens=3))
    try:
        with open_ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}") as ledger:
            off = _side(built, ledger, "off", None)
            on = _side(built, ledger, "on", tmp_path / "trace")
            with ledger.engine.connect() as conn:  # the ledger's request rows, one per request per side
                query = select(Run.note, func.count(Request.id)).join(Request).group_by(Run.note)
                counts = dict(conn.execute(query).all())
    finally:
        built.engine.close()
    trace = read_trace(tmp_path / "trace")
    assert trace.tables[TraceTable.REQUESTS].num_rows == 8  # each request recorded, as `run` records it
    assert sorted(trace.frame("requests")["output_tokens"]) == [3] * 8
    for side in (off, on):
        assert side["tokens"] == 24 and side["num_full_collections"] >= 1  # the serving loop's start-up one
        assert 0 < side["start_collection_s"] < side["s"]
        assert side["tokens_per_s_after_collection"] == pytest.approx(24 / (side["s"] - side["start_collection_s"]))
    assert "trace_cpu_share" not in off and 0 < on["trace_cpu_share"] < 1
    assert counts == {"bench_trace_overhead off": 8, "bench_trace_overhead on": 8}
    assert on["trace_rows"] == sum(t.num_rows for t in trace.tables.values())

# python fallbackgate/bench/results/trace-overhead-2026-12-07b/close-timing.py — what closing a 32-token run costs with
# and without the trace: the trace's close, then the rest (the ledger finishing and draining); medians of 10 pairs.
import pathlib
import statistics
import tempfile
import time

from fallbackgate.assembly import Overrides, assemble, no_policy
from fallbackgate.bench import trace_overhead as bench
from fallbackgate.ledger.db import open_ledger
from fallbackgate.ledger.writer import LedgerWriter
from fallbackgate.tracing.live import LiveTracer

built = assemble(no_policy(), Overrides(max_new_tokens=32))
timings: dict[str, list[tuple[float, float, float]]] = {"off": [], "on": []}
with tempfile.TemporaryDirectory() as tmp, open_ledger("sqlite:///" + tmp + "/l.sqlite") as ledger:
    scratch = pathlib.Path(tmp)
    bench._side(built, ledger, "warmup", scratch / "warmup")
    for i in range(10):
        for mode in ("off", "on"):
            writer, specs = LedgerWriter(ledger), bench._specs(f"{mode}{i}")
            tracer = LiveTracer(scratch / f"{mode}{i}", built.engine, {}) if mode == "on" else None
            recorder = built.recorder(writer, note="close timing")
            recorder.tracer = tracer
            outcome = recorder.serve(specs, built.settings)
            for spec, output in zip(specs, outcome.outputs, strict=True):
                recorder.on_request(output, spec.prompt)
            t0 = time.perf_counter()
            recorder._close_trace()
            t1 = time.perf_counter()
            recorder.close()
            t2 = time.perf_counter()
            timings[mode].append((t1 - t0, t2 - t1, t2 - t0))
built.engine.close()
for mode, rows in timings.items():
    trace_ms, rest_ms, total_ms = (1000 * statistics.median(r[k] for r in rows) for k in range(3))
    print(
        f"{mode} trace close {trace_ms:.1f} ms, rest of close (ledger drain) {rest_ms:.1f} ms, total {total_ms:.1f} ms"
    )

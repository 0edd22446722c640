"""python -m fallbackgate.bench.ledger_overhead --json bench-overhead.json [--reps 5] [--max-new-tokens 32]

What recording costs the decode loop, measured in one process on one engine:

- ledger overhead: the same prompts decoded with the ledger off and on (every step's events handed to
  the batched background LedgerWriter, plus the final drain to SQLite), in interleaved repetitions
  (off/on, then on/off, ...) so drift hits both sides; reported as median(on) / median(off) − 1.
  The engine's own accounting (tags, events, modeled time) runs on both sides: it is part of the step.
- audit cost: the exact baseline and the replay of the request's ledger trace (run for every request, as
  for an approximate one) plus their diff statistics, per request, as a fraction of that request's serving
  time (arrival to last token) and of the batch's decode loop; the run's numeric-floor control (3 requests
  x 16 positions fed token by token) is reported separately.

Model: the bundled tiny MoE when ``fallbackgate/tinymoe/checkpoint/config.json`` exists, else a seeded
random Qwen3-MoE checkpoint (needs the source tree's ``tests`` package). Goals (issue 4): ledger
overhead <= 3 %, audit <= 0.3 x the request's decode time. Prints the numbers and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from fallbackgate.assembly import Overrides, assemble, no_policy
from fallbackgate.audit.auditor import audit_request, floor_control, in_memory
from fallbackgate.audit.run_audit import FLOOR_POSITIONS
from fallbackgate.batch.prompts import BUILTIN_PROMPTS, PromptSpec
from fallbackgate.batch.session import RunOutcome, RunSettings, run_prompts
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.messages import StepPlan, StepResult
from fallbackgate.ledger.db import Ledger, open_ledger
from fallbackgate.ledger.writer import LedgerWriter
from fallbackgate.recording import RunRecorder, RunRow, controller_kind
from fallbackgate.tinymoe import CHECKPOINT_DIR

OVERHEAD_GOAL = 0.03
AUDIT_GOAL = 0.3


def _model_dir(requested: str | None, scratch: pathlib.Path) -> tuple[str, str]:
    """(checkpoint directory, description)."""
    if requested:
        return requested, "given"
    if (CHECKPOINT_DIR / "config.json").exists():
        return str(CHECKPOINT_DIR), "bundled tinymoe"
    from tests.checkpoints import make_checkpoint  # source tree only

    return str(make_checkpoint("qwen3_moe", scratch / "random-qwen3-moe", seed=0)), "random qwen3_moe (seed 0)"


def _specs(tag: str) -> list[PromptSpec]:
    return [PromptSpec(text, f"{tag}-{i}") for i, text in enumerate(BUILTIN_PROMPTS)]


class _TimedRecorder:
    """Hands steps to a writer, timing the calls (the decode thread's whole share of recording)."""

    def __init__(self, writer: LedgerWriter) -> None:
        self.writer, self.call_s, self.steps = writer, 0.0, []

    def record_step(self, plan: StepPlan, result: StepResult) -> None:
        started = time.perf_counter()
        self.writer.record_step(plan, result)
        self.call_s += time.perf_counter() - started
        self.steps.append((plan, result))

    def flush(self) -> None:
        self.writer.flush()


def _decode(
    engine: Engine, settings: RunSettings, tag: str, writer: LedgerWriter | _TimedRecorder | None
) -> tuple[float, float, RunOutcome]:
    """(wall s, process CPU s, outcome) from the first step until the last step's events are committed
    (ledger on) or the last step returned (ledger off). CPU time counts every thread, the writer's too."""
    wall, cpu = time.perf_counter(), time.process_time()
    outcome = run_prompts(engine, _specs(tag), settings, writer.record_step if writer else None, False)
    if writer is not None:
        writer.flush()
    return time.perf_counter() - wall, time.process_time() - cpu, outcome


def _start_run(writer: LedgerWriter, engine: Engine, note: str) -> None:
    """Insert the run row the benchmark's rows belong to (its writer records the steps itself)."""
    RunRecorder(writer, engine, RunRow(controller=controller_kind(engine.controller), note=note))


def _replay_s(ledger: Ledger, engine: Engine, steps: list[tuple[StepPlan, StepResult]]) -> float:
    """Seconds to turn `steps` into rows and commit them with nothing else running: the writer's work."""
    writer = LedgerWriter(ledger)
    _start_run(writer, engine, "bench_ledger_overhead replay")
    started = time.perf_counter()
    for plan, result in steps:
        writer.record_step(plan, result)
    writer.flush()
    seconds = time.perf_counter() - started
    writer.finish_run(status="complete")
    writer.close()
    return seconds


def _side(engine: Engine, settings: RunSettings, ledger: Ledger | None, tag: str) -> dict[str, float]:
    """One repetition of one side: wall and CPU seconds; with the ledger, the recording costs too."""
    if ledger is None:
        wall, cpu, _ = _decode(engine, settings, tag, None)
        return {"wall": wall, "cpu": cpu}
    writer = LedgerWriter(ledger)
    _start_run(writer, engine, f"bench_ledger_overhead {tag}")
    recorder = _TimedRecorder(writer)
    wall, cpu, outcome = _decode(engine, settings, tag, recorder)
    writer.finish_run(status="complete")
    writer.close()
    events = sum(len(s.events) for s in outcome.steps)
    replay = _replay_s(ledger, engine, recorder.steps)
    tokens = sum(len(o.output_token_ids) for o in outcome.outputs)
    return {
        "wall": wall,
        "cpu": cpu,
        "record_calls_s": recorder.call_s,
        "writer_s": replay,
        "events": events,
        "rows_per_token": _num_rows(recorder.steps) / max(1, tokens),
    }


def _num_rows(steps: list[tuple[StepPlan, StepResult]]) -> int:
    """Ledger rows the steps write: a step row, a row per request of the step, an event row per event and one
    per event naming its objects."""
    return sum(
        1 + len(plan.request_ids) + len(result.events) + sum(1 for e in result.events if e.object_ids)
        for plan, result in steps
    )


def _summary(off: list[dict[str, float]], on: list[dict[str, float]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for clock in ("wall", "cpu"):
        a, b = [r[clock] for r in off], [r[clock] for r in on]
        result[clock] = {
            "off_s": a,
            "on_s": b,
            "median_off_s": statistics.median(a),
            "median_on_s": statistics.median(b),
            "overhead": statistics.median(b) / statistics.median(a) - 1.0,
        }
    cost = statistics.median(r["record_calls_s"] + r["writer_s"] for r in on)
    result["components"] = {
        "record_calls_s": statistics.median(r["record_calls_s"] for r in on),
        "writer_s": statistics.median(r["writer_s"] for r in on),
        "overhead_bound": cost / min(r["wall"] for r in off),
    }
    return result


def measure_overhead(engine: Engine, settings: RunSettings, ledger_url: str, reps: int) -> dict[str, Any]:
    """Interleaved ledger-off / ledger-on repetitions of the same prompts on the same engine."""
    sides: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    with open_ledger(ledger_url) as ledger:
        _decode(engine, settings, "warmup", None)
        for rep in range(reps):
            for mode in ("off", "on") if rep % 2 == 0 else ("on", "off"):
                sides[mode].append(_side(engine, settings, ledger if mode == "on" else None, f"{mode}{rep}"))
    result = {
        "reps": reps,
        "events_per_run": int(sides["on"][-1]["events"]),
        "rows_per_token": sides["on"][-1]["rows_per_token"],
        "goal": OVERHEAD_GOAL,
    }
    result.update(_summary(sides["off"], sides["on"]))
    result["meets_goal"] = result["components"]["overhead_bound"] <= OVERHEAD_GOAL
    return result


def measure_audit(engine: Engine, settings: RunSettings, ledger: Ledger, reps: int = 3) -> dict[str, Any]:
    """Audit time of each request of one recorded batch (median of `reps`) against its serving time and the
    batch's decode loop: the exact baseline and the replay of its ledger trace (run for every request here,
    as for an approximate one), plus the run's floor control."""
    writer = LedgerWriter(ledger)
    _start_run(writer, engine, "bench_ledger_overhead audit")
    loop_s, _, outcome = _decode(engine, settings, "audit", writer)
    for output in outcome.outputs:
        writer.record_request(output)
    writer.finish_run(status="complete")
    rows = []
    for output in outcome.outputs:
        samples = []
        for _ in range(reps):
            started = time.perf_counter()
            ids = (output.prompt_token_ids, output.output_token_ids)
            audit_request(engine, ledger, writer.run_id, output.request_id, *ids, in_memory(output), True)
            samples.append(time.perf_counter() - started)
        serve_s = output.finish_s - output.arrival_s
        rows.append({"request_id": output.request_id, "audit_s": statistics.median(samples), "serve_s": serve_s})
    writer.close()
    started = time.perf_counter()
    floor_control(engine, outcome.outputs, FLOOR_POSITIONS)
    floor_s = time.perf_counter() - started
    total = sum(r["audit_s"] for r in rows)
    worst = max(r["audit_s"] / r["serve_s"] for r in rows)
    return {
        "requests": rows,
        "decode_loop_s": loop_s,
        "audit_total_s": total,
        "audit_over_decode_loop": total / loop_s,
        "mean_audit_over_request": statistics.mean(r["audit_s"] / r["serve_s"] for r in rows),
        "max_audit_over_request": worst,
        "numeric_floor_control_s": floor_s,
        "floor_over_decode_loop": floor_s / loop_s,
        "goal": AUDIT_GOAL,
        "meets_goal": worst <= AUDIT_GOAL,
    }


def _print(result: dict[str, Any]) -> None:
    o, a = result["overhead"], result["audit"]
    print(f"model: {result['model']} ({result['model_kind']}), {result['settings']}")
    for clock in ("wall", "cpu"):
        c = o[clock]
        print(
            f"ledger overhead ({clock}): median off {c['median_off_s']:.3f} s, on {c['median_on_s']:.3f} s "
            f"-> {100 * c['overhead']:+.2f} %  ({o['reps']} interleaved reps, {o['events_per_run']} events/run, "
            f"{o['rows_per_token']:.2f} ledger rows per generated token)"
        )
    comp = o["components"]
    print(
        f"recording cost per run: {1e3 * comp['record_calls_s']:.1f} ms in record_step calls + "
        f"{1e3 * comp['writer_s']:.1f} ms of writer work (rows + commit, replayed alone) -> at most "
        f"{100 * comp['overhead_bound']:.2f} % of the fastest ledger-off decode "
        f"(goal <= {100 * OVERHEAD_GOAL:.0f} %: {'met' if o['meets_goal'] else 'NOT met'})"
    )
    print(
        f"audit: mean {a['mean_audit_over_request']:.3f} x, max {a['max_audit_over_request']:.3f} x the request's "
        f"serving time; all requests {a['audit_over_decode_loop']:.3f} x the batch decode loop; "
        f"goal <= {AUDIT_GOAL} x: {'met' if a['meets_goal'] else 'NOT met'}"
    )
    print(
        f"numeric-floor control (once per run): {a['numeric_floor_control_s']:.3f} s = "
        f"{a['floor_over_decode_loop']:.3f} x the batch decode loop"
    )


def main(argv: list[str] | None = None) -> int:
    """Run both measurements, print them and write the JSON report."""
    p = argparse.ArgumentParser(prog="python -m fallbackgate.bench.ledger_overhead", description=__doc__.split("\n")[2])
    p.add_argument("--json", default="bench-overhead.json", help="where to write the results")
    p.add_argument("--model", default=None, help="checkpoint directory (default: bundled tinymoe, else random)")
    p.add_argument("--reps", type=int, default=5, help="repetitions of each side")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--device-budget-mb", type=float, default=None, help="default: everything on device")
    p.add_argument("--ledger", default=None, help="ledger URL (default: a fresh SQLite file in a temp dir)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        model, kind = _model_dir(args.model, pathlib.Path(scratch))
        policy = no_policy(model, memory={"device_budget_mb": args.device_budget_mb})
        built = assemble(policy, Overrides(max_new_tokens=args.max_new_tokens))
        engine, settings = built.engine, built.settings
        ledger_url = args.ledger or str(pathlib.Path(scratch) / "bench.sqlite")
        result = {
            "model": model,
            "model_kind": kind,
            "settings": {
                "prompts": len(BUILTIN_PROMPTS),
                "max_new_tokens": args.max_new_tokens,
                "device_budget_mb": args.device_budget_mb,
                "ledger": "sqlite" if not args.ledger else "given",
            },
            "host": {
                "python": sys.version.split()[0],
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "machine": platform.machine(),
            },
            "overhead": measure_overhead(engine, settings, ledger_url, args.reps),
        }
        with open_ledger(ledger_url) as ledger:
            result["audit"] = measure_audit(engine, settings, ledger)
    _print(result)
    pathlib.Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

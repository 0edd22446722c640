"""python -m fallbackgate.bench.ledger_volume [--json bench-volume.json] [--batch 32] [--steps 64]

How many ledger rows one generated token costs, and what recording them costs the decode loop:

- bundled model: the built-in prompts decoded on the bundled tiny MoE (everything resident), recorded through
  a LedgerWriter into SQLite; rows written (steps, step_requests, events, event_objects) per generated token.
- synthetic shape (default 48 MoE layers x 128 experts, top-8, batch 32): decode StepResults as the engine
  emits them for that shape with everything resident (each request uses top_k experts per layer; the
  request x layer usage the engine reports on its step), recorded through the same writer; the decode thread's
  record_step time plus the writer's row building and commit (wall, and CPU of every thread), per
  step, and as a fraction of a decode step of ``--decode-step-ms`` (the recording bound's denominator; the
  engine's measured step time on this machine is far larger, which would understate the fraction).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time
from typing import Any

from sqlalchemy import func, select

from fallbackgate.assembly import Overrides, assemble, no_policy
from fallbackgate.batch.prompts import BUILTIN_PROMPTS, PromptSpec
from fallbackgate.batch.session import run_prompts
from fallbackgate.engine.messages import Event, StepKind, StepPlan, StepResult
from fallbackgate.engine.step_context import EventLog
from fallbackgate.engine.tags import ObjectKind, Tag
from fallbackgate.ledger.db import Ledger, open_ledger
from fallbackgate.ledger.models import EventObjectsRow, EventRow, Step, StepRequest
from fallbackgate.ledger.writer import LedgerWriter
from fallbackgate.recording import RunRecorder, RunRow, controller_kind
from fallbackgate.tinymoe import CHECKPOINT_DIR

TABLES = {"steps": Step, "step_requests": StepRequest, "events": EventRow, "event_objects": EventObjectsRow}


def count_rows(ledger: Ledger, run_id: int) -> dict[str, int]:
    """Rows of each per-step table for one run."""
    with ledger.engine.connect() as conn:
        return {
            name: int(conn.execute(select(func.count()).where(model.run_id == run_id)).scalar_one())
            for name, model in TABLES.items()
        }


def bundled_rows(ledger: Ledger, max_new_tokens: int) -> dict[str, Any]:
    """Rows per generated token of the built-in prompts on the bundled model, everything resident."""
    policy = no_policy(str(CHECKPOINT_DIR), memory={"device_budget_mb": None})
    built = assemble(policy, Overrides(max_new_tokens=max_new_tokens))
    writer = LedgerWriter(ledger)
    RunRecorder(writer, built.engine, RunRow(controller=controller_kind(built.engine.controller), note="volume"))
    specs = [PromptSpec(text, f"v-{i}") for i, text in enumerate(BUILTIN_PROMPTS)]
    outcome = run_prompts(built.engine, specs, built.settings, writer.record_step, False)
    writer.finish_run(status="complete")
    writer.close()
    rows = count_rows(ledger, writer.run_id)
    tokens = sum(len(o.output_token_ids) for o in outcome.outputs)
    return {"rows": rows, "generated_tokens": tokens, "rows_per_token": sum(rows.values()) / tokens}


def synthetic_step(
    step_id: int, num_requests: int, num_layers: int, top_k: int, *, as_events: bool = False
) -> tuple[StepPlan, StepResult]:
    """One decode step of `num_requests` requests with every expert use resident, as the engine records it
    (`as_events`: as it did before 0010, one resident event per request × layer)."""
    request_ids = [f"r{i}" for i in range(num_requests)]
    log = EventLog(step_id)
    for rid in request_ids:
        for layer in range(num_layers):
            for _ in range(top_k):
                log.add(rid, layer, ObjectKind.EXPERT, Tag.RESIDENT)
            log.add_kv_reads(rid, layer, 4)
    ones, starts = dict.fromkeys(request_ids, 1), dict.fromkeys(request_ids, 64)
    plan = StepPlan(step_id, StepKind.DECODE, request_ids, ones, starts)
    events: list[Event] = log.events()
    result = StepResult(step_id, StepKind.DECODE, request_ids, dict.fromkeys(request_ids, 7), {}, events, 0.02, 0.02)
    result.kv_resident_reads = log.kv_resident_reads
    if as_events:
        result.events = [
            Event(step_id, rid, layer, ObjectKind.EXPERT, Tag.RESIDENT, n)
            for rid, by_layer in log.expert_resident_uses.items()
            for layer, n in by_layer.items()
        ]
    else:
        result.expert_resident_uses = log.expert_resident_uses
    return plan, result


def synthetic_cost(ledger: Ledger, engine: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Recording time per decode step of the synthetic shape: record_step calls, then the writer alone."""
    steps = [
        synthetic_step(i, args.batch, args.num_layers, args.top_k, as_events=args.as_events) for i in range(args.steps)
    ]
    writer = LedgerWriter(ledger)
    RunRecorder(writer, engine, RunRow(controller="volume", note="synthetic calls"))
    started, cpu = time.perf_counter(), time.process_time()
    for plan, result in steps:
        writer.record_step(plan, result)
    calls_s = time.perf_counter() - started
    writer.flush()
    total_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu
    writer.finish_run(status="complete")
    writer.close()
    rows = count_rows(ledger, writer.run_id)
    per_step_ms = 1e3 * total_s / args.steps
    return {
        "shape": {"num_layers": args.num_layers, "top_k": args.top_k, "batch": args.batch, "steps": args.steps},
        "resident_uses_as": "events" if args.as_events else "counts",
        "rows": rows,
        "rows_per_token": sum(rows.values()) / (args.steps * args.batch),
        "record_calls_ms_per_step": 1e3 * calls_s / args.steps,
        "recording_ms_per_step": per_step_ms,
        "recording_cpu_ms_per_step": 1e3 * cpu_s / args.steps,  # every thread's CPU: less hit by a loaded host
        "decode_step_ms": args.decode_step_ms,
        "fraction_of_decode": per_step_ms / args.decode_step_ms,
        "cpu_fraction_of_decode": 1e3 * cpu_s / args.steps / args.decode_step_ms,
    }


def main(argv: list[str] | None = None) -> int:
    """Measure both and print them; write JSON."""
    p = argparse.ArgumentParser(prog="python -m fallbackgate.bench.ledger_volume")
    p.add_argument("--json", default="bench-volume.json")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--num-layers", type=int, default=48)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--as-events", action="store_true", help="resident uses as event rows (before 0010)")
    p.add_argument("--decode-step-ms", type=float, default=25.0, help="decode step time the fraction is of")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch, open_ledger(str(pathlib.Path(scratch) / "v.sqlite")) as ledger:
        bundled = bundled_rows(ledger, args.max_new_tokens)
        policy = no_policy(str(CHECKPOINT_DIR), memory={"device_budget_mb": None})
        engine = assemble(policy, Overrides(max_new_tokens=1)).engine
        result = {"bundled": bundled, "synthetic": synthetic_cost(ledger, engine, args)}
    print(json.dumps(result, indent=2))
    pathlib.Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""python -m fallbackgate.bench.audit_cost --model DIR --json bench-audit.json [--device-budget-mb X]
[--host-budget-mb Y] [--force TAG ...] [--max-new-tokens 32] [--audit-cache-mb 256]

What auditing a run costs next to serving it, measured in one process on one engine: the built-in prompts
are served and recorded to a SQLite ledger, then every request is audited exactly as ``fallbackgate run``
does (the floor control up front, the exact baseline for each request, the replay for requests with an
approximate tag, the extra control for exact requests over the floor's tolerance). Reports wall seconds
of each part, per request (its audit against its own serving time, arrival to last token) and for the
whole batch, and how many expert reads the audit's own verified cache needed. Prints ratios, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from fallbackgate.assembly import Assembly, Overrides, assemble, fold_host_into_ram, no_policy
from fallbackgate.audit.run_audit import audit_outputs
from fallbackgate.batch.prompts import BUILTIN_PROMPTS, PromptSpec
from fallbackgate.batch.session import run_prompts
from fallbackgate.controllers.exact_lru import FORCEABLE_TAGS
from fallbackgate.ledger.db import open_ledger
from fallbackgate.ledger.writer import LedgerWriter
from fallbackgate.tinymoe import CHECKPOINT_DIR

GOAL = 0.3  # audit seconds per second of the request's own serving time


def measure(built: Assembly, ledger_url: str) -> dict[str, Any]:
    """Serve, record, then audit; wall seconds of each and their ratios."""
    engine, settings = built.engine, built.settings
    specs = [PromptSpec(text, f"bench-{i}") for i, text in enumerate(BUILTIN_PROMPTS)]
    with open_ledger(ledger_url) as ledger:
        writer = LedgerWriter(ledger)
        built.recorder(writer, note="bench_audit_cost")
        outcome = run_prompts(engine, specs, settings, writer.record_step, True)
        for output in outcome.outputs:
            writer.record_request(output)
        writer.flush()
        started = time.perf_counter()
        results, floor, _ = audit_outputs(engine, ledger, writer.run_id, outcome.outputs)
        audit_s = time.perf_counter() - started
        writer.finish_run(status="complete")
        writer.close()
    serve = [o.finish_s - o.arrival_s for o in outcome.outputs]
    engine.close()
    return {
        "serve_wall_s": outcome.wall_s,
        "audit_wall_s": audit_s,
        "audit_over_serving": audit_s / outcome.wall_s,
        "audit_per_request_over_its_serving": statistics.mean(audit_s / len(serve) / s for s in serve),
        "num_requests": len(outcome.outputs),
        "num_replayed": sum(r.replay is not None for r in results),
        "num_floor_requests": floor["num_requests"],
        "floor_max_kl": floor["max_kl"],
        "max_kl": max(r.stats.max_kl for r in results),
        "max_replay_kl": max((r.replay["max_kl"] for r in results if r.replay), default=None),
        "audit_expert_reads": engine.executor.audit_weights.num_reads,
        "expert_disk_reads_serving": engine.expert_store.num_disk_reads,
    }


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(CHECKPOINT_DIR))
    p.add_argument("--json", required=True)
    p.add_argument("--device-budget-mb", type=float, default=None)
    p.add_argument("--host-budget-mb", type=float, default=None)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--audit-cache-mb", type=float, default=256.0, help="the audit's own expert cache")
    p.add_argument("--force", action="append", default=[], choices=sorted(t.value for t in FORCEABLE_TAGS))
    args = p.parse_args(argv)
    device, host = fold_host_into_ram(args.device_budget_mb, args.host_budget_mb)  # a CPU: one RAM budget
    memory = {"device_budget_mb": device, "host_budget_mb": host}
    overrides = Overrides(
        max_new_tokens=args.max_new_tokens, force=tuple(args.force), audit_cache_mb=args.audit_cache_mb
    )
    built = assemble(no_policy(args.model, memory=memory), overrides)
    with tempfile.TemporaryDirectory() as scratch:
        result = measure(built, str(pathlib.Path(scratch) / "bench.sqlite"))
    result["settings"] = vars(args) | {"threads": torch.get_num_threads()}
    print(
        f"{args.model} force={args.force or 'none'}: served {result['num_requests']} requests in "
        f"{result['serve_wall_s']:.2f} s, audited in {result['audit_wall_s']:.2f} s = "
        f"{result['audit_over_serving']:.2f} x serving (per request "
        f"{result['audit_per_request_over_its_serving']:.2f} x "
        f"its own serving time; goal <= {GOAL}); replayed {result['num_replayed']}, floor over "
        f"{result['num_floor_requests']} requests (max KL {result['floor_max_kl']:.3g}); audit read "
        f"{result['audit_expert_reads']} experts from the checkpoint"
    )
    pathlib.Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

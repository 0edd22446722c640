"""python -m fallbackgate.bench.plan_check --json bench-plan.json [--config MODEL:DEVICE_MB:HOST_MB ...]
[--max-new-tokens 16]

``fallbackgate plan``'s predictions against measured runs: for each configuration (a checkpoint, a device
budget and a host budget in MB; "-" for none) the six built-in prompts are planned (prompt length, context
and concurrency as they will be served), then served on an exact engine: measured mean TTFT and TPOT
(wall clock) and the expert hit rate (resident expert uses / all expert uses, from the events) against the
plan's, each configuration's routing concentration fitted from the *other* configurations' recorded runs
(what ``fallbackgate plan --ledger`` does). Default configurations: the bundled model with everything
fitting, and a real-shaped OLMoE checkpoint (``python -m fallbackgate.synth --like olmoe-1b-7b
--num-layers 4 --out /work/ckpt/olmoe-4``) under three budgets. Prints each ratio, writes JSON; the target
is within 25 %.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
from typing import Any

from fallbackgate.assembly import Overrides, assemble, fold_host_into_ram, no_policy
from fallbackgate.batch.prompts import BUILTIN_PROMPTS, PromptSpec
from fallbackgate.batch.session import memory_summary, run_prompts
from fallbackgate.engine.config import MIB
from fallbackgate.engine.tags import ObjectKind, Tag
from fallbackgate.ledger.db import Ledger, open_ledger
from fallbackgate.ledger.writer import LedgerWriter
from fallbackgate.planning.history import routing_exponent
from fallbackgate.planning.plan import Workload, make_plan
from fallbackgate.planning.shape import model_shape
from fallbackgate.profiling.names import MEASURED
from fallbackgate.profiling.store import resolve_profile
from fallbackgate.tinymoe import CHECKPOINT_DIR

DEFAULT_CONFIGS = (
    f"{CHECKPOINT_DIR}:-:-",
    "/work/ckpt/olmoe-4:1024:1024",
    "/work/ckpt/olmoe-4:1536:2048",
    "/work/ckpt/olmoe-4:2048:4096",
)
TARGET = 0.25


def _mb(text: str) -> float | None:
    return None if text == "-" else float(text)


def measure(config: str, max_new_tokens: int, ledger: Ledger) -> dict[str, Any]:
    """Serve the built-in prompts on one configuration (after a warm-up pass), recording to `ledger`."""
    model, device_mb, host_mb = config.rsplit(":", 2)
    device, host = fold_host_into_ram(_mb(device_mb), _mb(host_mb))  # on a CPU one RAM budget (no host tier)
    memory = {"device_budget_mb": device, "host_budget_mb": host}
    built = assemble(no_policy(model, memory=memory), Overrides(max_new_tokens=max_new_tokens))
    engine, settings = built.engine, built.settings
    specs = [PromptSpec(text, f"plan-{i}") for i, text in enumerate(BUILTIN_PROMPTS)]
    run_prompts(engine, specs, settings, None, False)  # warm-up: caches filled as a serving process has them
    writer = LedgerWriter(ledger)
    run_id = built.recorder(writer, note=f"bench_plan_check {config}").run_id
    outcome = run_prompts(
        engine, [PromptSpec(s.prompt, s.request_id + "b") for s in specs], settings, writer.record_step, True
    )
    writer.record_memory(memory_summary(engine))
    writer.finish_run(status="complete")
    writer.close()
    engine.close()
    hits = uses = 0
    for step in outcome.steps:
        resident = sum(n for layers in step.expert_resident_uses.values() for n in layers.values())
        hits, uses = hits + resident, uses + resident
        for e in step.events:
            if e.object_kind is ObjectKind.EXPERT:
                uses += e.count
                hits += e.count if e.tag is Tag.RESIDENT else 0
    return {
        "run_id": run_id,
        "prompt_tokens": round(statistics.mean(len(o.prompt_token_ids) for o in outcome.outputs)),
        "ttft_ms": 1e3 * statistics.mean(o.ttft_s for o in outcome.outputs),
        "tpot_ms": 1e3 * statistics.mean(o.tpot_s for o in outcome.outputs),
        "hit_rate": hits / uses if uses else 1.0,
    }


def predict(config: str, max_new_tokens: int, prompt: int, ledger: Ledger, own_run: int) -> dict[str, Any]:
    """The plan for one configuration, its routing fitted from the other configurations' recorded runs."""
    model, device_mb, host_mb = config.rsplit(":", 2)
    shape = model_shape(model)
    alpha = routing_exponent(ledger, shape, exclude_run_ids={own_run})
    to_bytes = lambda mb: None if mb is None else int(mb * MIB)  # noqa: E731
    workload = Workload(
        prompt + max_new_tokens // 2,
        len(BUILTIN_PROMPTS),
        to_bytes(_mb(device_mb)),
        to_bytes(_mb(host_mb)),
        prompt_tokens=prompt,
        routing_exponent=alpha or 1.0,
    )
    plan = make_plan(shape, resolve_profile(MEASURED), workload)
    return {"ttft_ms": plan.ttft_ms, "tpot_ms": plan.tpot_ms, "hit_rate": plan.hit_rate, "routing_exponent": alpha}


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True)
    p.add_argument("--config", action="append", default=None, help="MODEL:DEVICE_MB:HOST_MB ('-': no budget)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    args = p.parse_args(argv)
    configs = args.config or [c for c in DEFAULT_CONFIGS if pathlib.Path(c.rsplit(":", 2)[0]).exists()]
    resolve_profile(MEASURED)  # measure this machine first if it has no profile yet (not inside a timing)
    results = []
    with tempfile.TemporaryDirectory() as scratch, open_ledger(str(pathlib.Path(scratch) / "plan.sqlite")) as ledger:
        measured = {config: measure(config, args.max_new_tokens, ledger) for config in configs}
        for config, m in measured.items():
            p = predict(config, args.max_new_tokens, m["prompt_tokens"], ledger, m["run_id"])
            keys = ("ttft_ms", "tpot_ms", "hit_rate")
            errors = {k: abs(p[k] - m[k]) / m[k] if m[k] else 0.0 for k in keys}
            results.append(
                {
                    "config": config,
                    "predicted": p,
                    "measured": m,
                    "relative_error": errors,
                    "within_target": all(e <= TARGET for e in errors.values()),
                }
            )
            cells = ", ".join(f"{k} {p[k]:.3g} vs {m[k]:.3g} ({100 * errors[k]:.0f} %)" for k in keys)
            alpha = "uniform" if p["routing_exponent"] is None else f"{p['routing_exponent']:.2f} from the other runs"
            print(f"{config}: routing {alpha}; predicted vs measured: {cells}")
    pathlib.Path(args.json).write_text(json.dumps({"target": TARGET, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""python -m fallbackgate.bench.plan_check --json bench-plan.json [--config MODEL:DEVICE_MB:HOST_MB ...]
[--max-new-tokens 16]

``fallbackgate plan``'s predictions against measured runs: for each configuration (a checkpoint, a device
budget and a host budget in MB; "-" for none) the six built-in prompts are planned (prompt length, context
and concurrency as they will be served), then served on an exact engine: measured mean TTFT and TPOT
(wall clock) and the expert hit rate (resident expert uses / all expert uses, from the events) against the
plan's. Default configurations: the bundled model with everything fitting, and a real-shaped OLMoE
checkpoint (``python -m fallbackgate.synth --like olmoe-1b-7b --num-layers 4 --out /work/ckpt/olmoe-4``)
under two budgets. Prints each ratio, writes JSON; the target is within 25 %.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
from typing import Any

from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import MIB
from fallbackgate.engine.tags import ObjectKind, Tag
from fallbackgate.planning.plan import Workload, make_plan
from fallbackgate.planning.shape import model_shape
from fallbackgate.profiling.store import resolve_profile
from fallbackgate.serving.prompts import BUILTIN_PROMPTS, PromptSpec
from fallbackgate.serving.session import RunSettings, build_engine, run_prompts
from fallbackgate.tinymoe import CHECKPOINT_DIR

DEFAULT_CONFIGS = (f"{CHECKPOINT_DIR}:-:-", "/work/ckpt/olmoe-4:1024:1024", "/work/ckpt/olmoe-4:2048:4096")
TARGET = 0.25


def _mb(text: str) -> float | None:
    return None if text == "-" else float(text)


def check(config: str, max_new_tokens: int) -> dict[str, Any]:
    """Plan, then serve and measure one configuration."""
    model, device_mb, host_mb = config.rsplit(":", 2)
    settings = RunSettings(
        model, max_new_tokens=max_new_tokens, device_budget_mb=_mb(device_mb), host_budget_mb=_mb(host_mb)
    )
    engine = build_engine(settings, ExactLRUController())
    prompt_lens = [len(engine.tokenizer.encode(p)) for p in BUILTIN_PROMPTS]
    prompt = round(statistics.mean(prompt_lens))
    to_bytes = lambda mb: None if mb is None else int(mb * MIB)  # noqa: E731
    workload = Workload(
        prompt + max_new_tokens // 2,
        len(BUILTIN_PROMPTS),
        to_bytes(_mb(device_mb)),
        to_bytes(_mb(host_mb)),
        settings.block_size,
        prompt_tokens=prompt,
    )
    plan = make_plan(model_shape(model), engine.config.profile, workload)
    specs = [PromptSpec(text, f"plan-{i}") for i, text in enumerate(BUILTIN_PROMPTS)]
    run_prompts(engine, specs, settings, None, False)  # warm-up: caches filled as a serving process has them
    outcome = run_prompts(engine, [PromptSpec(s.prompt, s.request_id + "b") for s in specs], settings, None, True)
    engine.close()
    hits = uses = 0
    for step in outcome.steps:
        for e in step.events:
            if e.object_kind is ObjectKind.EXPERT:
                uses += e.count
                hits += e.count if e.tag is Tag.RESIDENT else 0
    measured = {
        "ttft_ms": 1e3 * statistics.mean(o.ttft_s for o in outcome.outputs),
        "tpot_ms": 1e3 * statistics.mean(o.tpot_s for o in outcome.outputs),
        "hit_rate": hits / uses if uses else 1.0,
    }
    predicted = {"ttft_ms": plan.ttft_ms, "tpot_ms": plan.tpot_ms, "hit_rate": plan.hit_rate}
    errors = {k: abs(predicted[k] - measured[k]) / measured[k] if measured[k] else 0.0 for k in measured}
    return {
        "config": config,
        "predicted": predicted,
        "measured": measured,
        "relative_error": errors,
        "within_target": all(e <= TARGET for e in errors.values()),
    }


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True)
    p.add_argument("--config", action="append", default=None, help="MODEL:DEVICE_MB:HOST_MB ('-': no budget)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    args = p.parse_args(argv)
    configs = args.config or [c for c in DEFAULT_CONFIGS if pathlib.Path(c.rsplit(":", 2)[0]).exists()]
    resolve_profile("measured")  # measure this machine first if it has no profile yet (not inside a timing)
    results = []
    for config in configs:
        r = check(config, args.max_new_tokens)
        results.append(r)
        cells = ", ".join(
            f"{k} {r['predicted'][k]:.3g} vs {r['measured'][k]:.3g} ({100 * r['relative_error'][k]:.0f} %)"
            for k in r["measured"]
        )
        print(f"{config}: predicted vs measured: {cells}")
    pathlib.Path(args.json).write_text(json.dumps({"target": TARGET, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

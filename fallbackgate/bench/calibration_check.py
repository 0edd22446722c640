"""python -m fallbackgate.bench.calibration_check [--model DIR] [--ledger URL] [--out FILE] [--requests N]

Does a calibration fitted on one workload keep another workload's requests within budget?

1. Workload A (seed 1, even-numbered passages) runs in enforce mode with the joint controller under a
   policy whose class ``best-effort`` allows the approximate tags (expert_defer, expert_lowbit, kv_dequant)
   and recompute, under device-memory (40 % of expert bytes + 50 % of peak KV) and deadline pressure;
   every request is audited against the exact baseline and recorded.
2. Workload B (seed 2, odd-numbered passages: different prompts) runs with the default cost scales.
3. ``fallbackgate calibrate --run <A>`` fits per tag × layer scales from A's ledger rows.
4. Workload B runs again with the calibration loaded.

For each run it counts the requests whose measured statistics stay within the class budget (the gate's
per-request verdict), prints them and writes JSON. The goal is >= 95 % for B after calibration; the gate
reports the other requests with their reasons.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
from typing import Any

from transformers import AutoTokenizer

from fallbackgate.audit.gate import evaluate_run
from fallbackgate.controllers.cost import fit_calibration, store_calibration
from fallbackgate.engine.tags import NON_EXACT_TAGS, Tag
from fallbackgate.ledger.db import Ledger, open_ledger
from fallbackgate.policy.schema import ControllerKind, Policy
from fallbackgate.sweep.grid import SweepConfig, grid_cells, reference_run, run_cell
from fallbackgate.sweep.workload import BEST_EFFORT, WorkloadSpec, build_workload, default_policy
from fallbackgate.tinymoe import CHECKPOINT_DIR

GOAL = 0.95


def check_policy(tpot_ms: float = 0.05) -> Policy:
    """The sweep's policy with a best-effort deadline tight enough that the joint controller falls back, and
    without cpu_execute (which would absorb every late expert at no quality cost): approximate tags only."""
    data = default_policy(tpot_ms=(1.0, tpot_ms)).model_dump()
    data["default_class"] = BEST_EFFORT
    data["classes"][BEST_EFFORT]["budget"]["allowed_tags"] = [
        t.value for t in NON_EXACT_TAGS if t is not Tag.CPU_EXECUTE
    ]
    return Policy.model_validate(data)


def within_budget(ledger: Ledger, run_id: int) -> dict[str, Any]:
    """The gate's per-request verdicts of ``run_id``: how many passed, and the others with reasons."""
    verdict = evaluate_run(ledger, run_id)
    failed = [{"request_id": r.request_id, "reasons": r.reasons} for r in verdict.requests if not r.passed]
    total = len(verdict.requests)
    return {
        "run_id": run_id,
        "requests": total,
        "within_budget": total - len(failed),
        "fraction": (total - len(failed)) / total if total else 0.0,
        "failed": failed,
    }


def _run(cfg: SweepConfig, ref: Any, ledger: Ledger, cell: dict[str, Any], label: str) -> dict[str, Any]:
    point = run_cell(cfg, ref, ledger, ControllerKind.JOINT.value, cell, f"calibration-check {label}")
    result = within_budget(ledger, point["run_id"])
    m = point["metrics"]
    keys = ("mean_kl", "max_p99_kl", "top1_agreement", "tag_expert_defer", "tag_expert_lowbit", "tag_kv_dequant")
    result["metrics"] = {k: m[k] for k in keys} | {"tag_cpu_execute": m["tag_cpu_execute"]}
    print(f"{label}: {result['within_budget']}/{result['requests']} requests within budget (run {point['run_id']})")
    return result


def run_check(model_dir: str, ledger_url: str, num_requests: int = 20, tpot_ms: float = 0.05) -> dict[str, Any]:
    """Steps 1-4 of the module docstring; returns the JSON-able result."""
    ledger = open_ledger(ledger_url)
    num_long = max(1, num_requests // 5)
    spec_a = WorkloadSpec(seed=1, num_chats=num_requests - num_long, num_long=num_long, strict_share=0.0, split="a")
    cfg = SweepConfig(model_dir, check_policy(tpot_ms), expert_fracs=(0.4,), kv_fracs=(0.5,), workload=spec_a)
    cfg.progress = False
    ref_a = reference_run(cfg)
    cell = grid_cells(cfg, ref_a)[0]
    cfg_b = dataclasses.replace(cfg, workload=dataclasses.replace(spec_a, seed=2, split="b"))
    ref_b = dataclasses.replace(ref_a, specs=build_workload(cfg_b.workload, AutoTokenizer.from_pretrained(model_dir)))
    try:
        a = _run(cfg, ref_a, ledger, cell, "A (default scales)")
        b_before = _run(cfg_b, ref_b, ledger, cell, "B (default scales)")
        fitted = fit_calibration(ledger, [a["run_id"]], 0.95)
        store_calibration(ledger, fitted)
        rc = 0 if fitted.num_requests else 1  # as `fallbackgate calibrate` exits
        b_after = _run(cfg_b, ref_b, ledger, cell, "B (calibrated on A)")
    finally:
        ledger.close()
    return {
        "model": model_dir,
        "cell": cell,
        "tpot_ms_best_effort": tpot_ms,
        "calibrate_exit_status": rc,
        "A": a,
        "B_default_scales": b_before,
        "B_calibrated": b_after,
        "goal": GOAL,
        "goal_met": b_after["fraction"] >= GOAL,
    }


def main(argv: list[str] | None = None) -> int:
    """Command line: run the check, print, write JSON; exit 0 when the goal is met, 1 otherwise."""
    prog = "python -m fallbackgate.bench.calibration_check"
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[2])
    p.add_argument("--model", default=str(CHECKPOINT_DIR), help="checkpoint directory (default: bundled tiny MoE)")
    p.add_argument("--ledger", default=None, help="ledger URL (default: calibration_check.sqlite next to --out)")
    p.add_argument("--out", default="fallbackgate/sweep_results/calibration/calibration_check.json")
    p.add_argument("--requests", type=int, default=20, help="requests per workload")
    p.add_argument("--tpot-ms", type=float, default=0.05, help="best-effort modeled TPOT target (pressure)")
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    ledger_url = args.ledger or str(out.with_suffix(".sqlite"))
    if args.ledger is None and pathlib.Path(ledger_url).exists():
        pathlib.Path(ledger_url).unlink()  # a fresh ledger: no earlier calibration leaks into run A
    result = run_check(args.model, ledger_url, args.requests, args.tpot_ms)
    out.write_text(json.dumps(result, indent=1) + "\n")
    b = result["B_calibrated"]
    print(f"B after calibration: {b['within_budget']}/{b['requests']} = {b['fraction']:.1%} (goal {GOAL:.0%})")
    print(f"wrote {out}")
    return 0 if result["goal_met"] else 1


if __name__ == "__main__":
    sys.exit(main())

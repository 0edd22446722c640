"""python -m fallbackgate.bench.dashboard_queries --json bench-dashboard.json [--events 1000000] [--ledger PATH]
   [--repeats 3]

Builds a SQLite ledger of ``--events`` synthetic events (``fallbackgate.ledger.synthetic`` messages through the
LedgerWriter: several runs and policies, 8 requests of two classes per run, 16 layers, per-position
diffs, request statistics, run verdicts, calibration scales), or reuses ``--ledger`` when that file
exists, then renders every dashboard page with Streamlit's AppTest, caches cleared before each render.
Prints seconds per page (median of ``--repeats``) and writes them as JSON. Goal (issue 7): <= 3 s per page.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from fallbackgate.engine.tags import Tag
from fallbackgate.ledger.db import ENV_VAR, open_ledger
from fallbackgate.ledger.synthetic import synthetic_output, synthetic_step
from fallbackgate.ledger.vocabulary import EXACT_TAG_NAMES
from fallbackgate.ledger.writer import LedgerWriter
from fallbackgate.policy.schema import AuditMode, ControllerKind
from fallbackgate.resources import package_dir

GOAL_S = 3.0
PAGES = ("overview", "drift", "request", "calibration", "sweep")
APP = package_dir("fallbackgate.dashboard") / "app.py"
REQUESTS, LAYERS, EVENTS_PER_LAYER, RUNS = 8, 16, 4, 10
KINDS = (ControllerKind.JOINT, ControllerKind.STATIC_SPLIT, ControllerKind.EXACT_LRU, ControllerKind.INDEPENDENT_LRU)
POLICIES = tuple(k.value for k in KINDS)


def _diffs(n: int, scale: float, rng: np.random.Generator) -> tuple[list[Any], Any]:
    kl = rng.exponential(scale, n) if scale > 0 else np.full(n, 1e-14)
    agree = rng.random(n) > min(0.5, scale * 50)
    logp_exact = -rng.random(n) * 5
    logp_engine = logp_exact - kl
    diffs = [
        SimpleNamespace(
            position=i,
            token_id=int(i % 100),
            kl=float(kl[i]),
            top1_agree=bool(agree[i]),
            delta_p=float(-kl[i] / 10),
            max_abs_dlogit=float(np.sqrt(kl[i])),
            vllm_top5_ok=True,
            logp_exact=float(logp_exact[i]),
            logp_engine=float(logp_engine[i]),
        )
        for i in range(n)
    ]
    first = next((i for i in range(n) if not agree[i]), None)
    stats = SimpleNamespace(
        num_positions=n,
        mean_kl=float(kl.mean()),
        median_kl=float(np.median(kl)),
        p99_kl=float(np.percentile(kl, 99)),
        max_kl=float(kl.max()),
        sem_kl=float(kl.std() / np.sqrt(n)),
        top1_agreement=float(agree.mean()),
        rms_delta_p=float(np.sqrt(np.mean((kl / 10) ** 2))),
        ppl_ratio=float(np.exp(np.mean(logp_exact - logp_engine))),
        first_divergence=first,
    )
    return diffs, stats


def _write_run(writer: LedgerWriter, index: int, steps: int, rng: np.random.Generator) -> None:
    policy = POLICIES[index % len(POLICIES)]
    exact = policy == ControllerKind.EXACT_LRU
    writer.start_run(model_path=f"model-{index % 2}", controller=policy, mode=AuditMode.ENFORCE.value)
    rids = [f"req-{i}" for i in range(REQUESTS)]
    tags = EXACT_TAG_NAMES if exact else None
    for s in range(steps):
        plan, result = synthetic_step(
            s,
            rids,
            num_layers=LAYERS,
            events_per_layer=EVENTS_PER_LAYER,
            rng=random.Random(index * 100_000 + s),
            tags=tags,
        )
        writer.record_step(plan, result)
    for i, rid in enumerate(rids):
        out = dataclasses.replace(synthetic_output(rid, num_output=steps), request_class=("chat", "batch")[i % 2])
        writer.record_request(out, slo={"ttft_ms": 600, "tpot_ms": 100}, budget={"max_mean_kl": 0.01})
        diffs, stats = _diffs(steps, 0.0 if exact else 0.004 * (1 + index % 3), rng)
        writer.record_diffs(rid, diffs, stats)
    writer.record_control(2e-14)
    writer.record_verdict(None, exact or index % 3 != 2, "synthetic")
    writer.finish_run()


def build(path: Path, num_events: int) -> dict[str, Any]:
    """Write the benchmark ledger at ``path``; return its size and how long writing took."""
    per_step = REQUESTS * LAYERS * EVENTS_PER_LAYER
    steps = max(1, num_events // per_step // RUNS)
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    with open_ledger(str(path)) as ledger, LedgerWriter(ledger) as writer:
        for index in range(RUNS):
            _write_run(writer, index, steps, rng)
        for layer in range(LAYERS):
            writer.record_calibration(Tag.KV_DEQUANT.value, layer, 1.0 + layer / 10, num_samples=100, run_ids=[1])
    return {
        "events": steps * per_step * RUNS,
        "runs": RUNS,
        "steps_per_run": steps,
        "build_s": time.perf_counter() - start,
    }


def render_seconds(page: str, repeats: int) -> list[tuple[float, float]]:
    """(wall, CPU) seconds to render ``page`` from cold caches, ``repeats`` times."""
    from streamlit.testing.v1 import AppTest

    from fallbackgate.dashboard import data

    logging.getLogger("streamlit").setLevel(logging.ERROR)  # "no runtime found" notes from the caches
    out = []
    for _ in range(repeats):
        data.clear_caches()
        at = AppTest.from_file(str(APP), default_timeout=300)
        at.query_params["page"] = page
        start, cpu = time.perf_counter(), time.process_time()
        at.run()
        out.append((time.perf_counter() - start, time.process_time() - cpu))
        if at.exception or at.error:
            raise RuntimeError(f"page {page} failed: {[e.value for e in [*at.exception, *at.error]]}")
    return out


def main(argv: list[str] | None = None) -> int:
    """Build (or reuse) the ledger, time every page, print and write the results."""
    prog = "python -m fallbackgate.bench.dashboard_queries"
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[3])
    p.add_argument("--json", default="bench-dashboard.json", help="where to write the results")
    p.add_argument("--events", type=int, default=1_000_000, help="events in the built ledger")
    p.add_argument("--ledger", default=None, help="SQLite file: reused when it exists, else built there")
    p.add_argument("--repeats", type=int, default=3, help="renders per page (median reported)")
    args = p.parse_args(argv)
    path = Path(args.ledger) if args.ledger else Path(tempfile.mkdtemp(prefix="fallbackgate-dash-bench-")) / "l.sqlite"
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "loadavg_1m": os.getloadavg()[0], "python": platform.python_version()},
        "goal_s_per_page": GOAL_S,
        "ledger": {"path": str(path)},
    }
    if not path.exists():
        results["ledger"].update(build(path, args.events))
    print(f"ledger {path}: {json.dumps(results['ledger'])}")
    os.environ[ENV_VAR] = str(path)
    render_seconds("sweep", 1)  # imports and the script's first compile, outside the timings
    pages = {}
    for page in PAGES:
        runs = render_seconds(page, args.repeats)
        pages[page] = {
            "median_s": round(statistics.median(r[0] for r in runs), 3),
            "median_cpu_s": round(statistics.median(r[1] for r in runs), 3),  # the machine may be shared
            "runs_s": [round(r[0], 3) for r in runs],
        }
        r = pages[page]
        verdict = "meets" if r["median_s"] <= GOAL_S else "over"
        print(f"{page:<12} {r['median_s']:>7.3f} s wall, {r['median_cpu_s']:.3f} s CPU ({verdict} goal {GOAL_S} s)")
    results["pages"] = pages
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

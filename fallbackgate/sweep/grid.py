"""Budget sweep: every controller over an expert budget × KV budget grid on one mixed workload.

A reference run (exact, unlimited device budget) sizes the grid: expert budgets are fractions of all
routed expert bytes, KV budgets fractions of the workload's peak KV bytes; a cell's device budget is their
sum (``static_split`` gets the cell's expert share as its split). Every cell × controller is one enforce
run recorded to the ledger (``controller`` set, ``note`` = ``sweep <id> {...cell as JSON...}``), audited
against the exact baseline and judged by the gate. Each run's expert-access trace is recorded
(:class:`fallbackgate.sweep.belady.TraceRecorder`) and Belady's MIN computed on it. The JSON written by
:func:`write_outputs` is what the dashboard's Budget sweep page reads (``$FALLBACKGATE_SWEEP_JSON``).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm

from fallbackgate.audit.auditor import audit_output, floor_control
from fallbackgate.audit.gate import evaluate_run
from fallbackgate.batch.prompts import PromptSpec
from fallbackgate.batch.recording import serve_recorded, versions
from fallbackgate.batch.session import RunOutcome, RunSettings, run_prompts
from fallbackgate.controllers import make_controller
from fallbackgate.controllers.cost import CostModel, load_calibration
from fallbackgate.engine.config import MIB, EngineConfig
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.tags import Exactness, ObjectKind
from fallbackgate.ledger.db import Ledger
from fallbackgate.ledger.writer import LedgerWriter
from fallbackgate.policy.loader import hardware_profile
from fallbackgate.policy.schema import Policy
from fallbackgate.sweep.belady import TraceRecorder, belady_misses, lru_misses
from fallbackgate.sweep.metrics import headline, quality_metrics, slo_metrics, tag_mix, timing_metrics
from fallbackgate.sweep.workload import WorkloadSpec, build_workload

CONTROLLERS: tuple[str, ...] = ("joint", "static_split", "independent_lru", "exact_lru")


@dataclasses.dataclass(slots=True)
class SweepConfig:
    """What to sweep: model, policy (classes, SLOs, budgets, hardware), grid, controllers, workload."""

    model_dir: str
    policy: Policy
    expert_fracs: tuple[float, ...] = (0.2, 0.4, 0.6, 0.8)
    kv_fracs: tuple[float, ...] = (0.5,)
    controllers: tuple[str, ...] = CONTROLLERS
    workload: WorkloadSpec = dataclasses.field(default_factory=WorkloadSpec)
    audit_rate: float = 1.0  # 1: every request audited; below 1 a seeded sample
    headline_expert_frac: float = 0.4  # the cell (with the smallest KV fraction) of the headline comparison
    static_fracs: tuple[float, ...] = (0.2, 0.5, 0.8, 0.9)  # static splits tried at the headline budget
    is_equivalent_allowed: bool = True  # baselines may serve late misses with the equivalent tags joint uses
    progress: bool = True


@dataclasses.dataclass(slots=True)
class Reference:
    """What the unconstrained exact run tells the grid."""

    specs: list[PromptSpec]
    bytes_per_expert: int
    expert_bytes_total: int
    peak_kv_bytes: int
    top_k: int
    trace_len: int
    modeled_tpot_ms: float
    tpot_ms: float  # measured


def top_k_of(model_dir: str) -> int:
    """Experts per token of a checkpoint (1 when its config does not say)."""
    cfg = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    return int(cfg.get("num_experts_per_tok") or 1)


def build_engine(
    cfg: SweepConfig, kind: str, device_budget: int | None, cost: CostModel | None, split: float
) -> Engine:
    """An enforce-mode engine whose controller (``kind``, wrapped to record its trace) serves ``cfg.policy``."""
    policy = cfg.policy
    inner = make_controller(
        kind,
        policy,
        cost_model=cost,
        top_k=top_k_of(cfg.model_dir),
        expert_fraction=split,
        is_equivalent_allowed=cfg.is_equivalent_allowed,
    )
    config = EngineConfig(
        model_dir=cfg.model_dir,
        device_budget_bytes=device_budget,
        block_size=policy.memory.block_size,
        max_num_seqs=policy.memory.max_num_seqs,
        preempt_mode=policy.memory.preempt_mode,
        expert_lowbit_bits=policy.controller.expert_lowbit_bits,
        profile=hardware_profile(policy),
        seed=cfg.workload.seed,
    )
    engine = Engine(config, TraceRecorder(inner))
    engine.is_observe = False
    return engine


def reference_run(cfg: SweepConfig) -> Reference:
    """Exact, unlimited device budget: peak KV bytes, expert sizes, the trace length, unpressured TPOT."""
    engine = build_engine(cfg, "exact_lru", None, None, 0.5)
    specs = build_workload(cfg.workload, engine.tokenizer)
    outcome = run_prompts(engine, specs, RunSettings(model_dir=cfg.model_dir, seed=cfg.workload.seed), None, False)
    memory = outcome.memory
    tpots = [o.modeled_tpot_s for o in outcome.outputs if len(o.output_token_ids) > 1]
    measured = [o.tpot_s for o in outcome.outputs if len(o.output_token_ids) > 1]
    return Reference(
        specs,
        memory["bytes_per_expert"],
        memory["expert_bytes_total"],
        max(s.num_device_bytes_kv for s in outcome.steps),
        top_k_of(cfg.model_dir),
        len(engine.controller.trace),
        1000 * sum(tpots) / max(1, len(tpots)),
        1000 * sum(measured) / max(1, len(measured)),
    )


def byte_metrics(outcome: RunOutcome) -> dict[str, float]:
    """Bytes moved over links by events: total, exact-class, and exact loads per object kind."""
    out = Counter()
    for step in outcome.steps:
        for e in step.events:
            out["bytes_total"] += e.bytes_moved
            if e.tag.exactness is Exactness.EXACT:
                out["bytes_exact"] += e.bytes_moved
                kind = "expert" if e.object_kind is ObjectKind.EXPERT else "kv"
                out[f"{kind}_exact_bytes"] += e.bytes_moved
    return {k: float(out[k]) for k in ("bytes_total", "bytes_exact", "expert_exact_bytes", "kv_exact_bytes")}


def belady_metrics(trace: list[Any], bytes_per_expert: int, expert_budget: int, device_budget: int) -> dict[str, float]:
    """Belady's MIN (and LRU) loads on ``trace`` with the cell's expert slots and with the whole device budget."""
    slots = max(1, expert_budget // bytes_per_expert)
    all_slots = max(1, device_budget // bytes_per_expert)
    return {
        "trace_len": float(len(trace)),
        "expert_slots": float(slots),
        "belady_expert_bytes": float(belady_misses(trace, slots) * bytes_per_expert) if trace else 0.0,
        "belady_expert_bytes_all_slots": float(belady_misses(trace, all_slots) * bytes_per_expert) if trace else 0.0,
        "lru_expert_bytes": float(lru_misses(trace, slots) * bytes_per_expert) if trace else 0.0,
    }


def audit_and_record(engine: Engine, outcome: RunOutcome, writer: LedgerWriter, cfg: SweepConfig) -> dict[str, Any]:
    """Record requests (with class SLO and budget), audit, finish the run, judge it; quality metrics back."""
    classes = cfg.policy.classes
    for spec, output in zip(outcome.specs, outcome.outputs, strict=True):
        cls = classes[spec.request_class]
        writer.record_request(output, prompt=spec.prompt, slo=cls.slo.model_dump(), budget=cls.budget.as_gate_dict())
    audited = outcome.outputs if cfg.audit_rate >= 1 else outcome.outputs[:: max(1, round(1 / cfg.audit_rate))]
    stats = []
    for output in audited:
        diffs, st = audit_output(engine, output)
        writer.record_diffs(output.request_id, diffs, st)
        stats.append(st)
    floor = floor_control(engine, audited)
    writer.record_control(floor["max_kl"], floor=floor)
    writer.finish_run(status="complete")
    writer.close()
    verdict = evaluate_run(writer.ledger, writer.run_id)
    return quality_metrics(stats, verdict)


def run_cell(cfg: SweepConfig, ref: Reference, ledger: Ledger, kind: str, cell: dict[str, Any], note: str) -> dict:
    """One recorded, audited run of controller ``kind`` in ``cell``; returns the sweep point."""
    expert_budget, kv_budget = cell["expert_budget_bytes"], cell["kv_budget_bytes"]
    device = expert_budget + kv_budget
    split = cell.get("static_frac") or min(0.99, max(0.01, expert_budget / device))
    cost = load_calibration(ledger, cfg.policy.controller.expert_lowbit_bits or 8)
    engine = build_engine(cfg, kind, device, cost, split)
    writer = LedgerWriter(ledger)
    run_id = writer.start_run(
        policy=cfg.policy.model_dump_json(),
        model_path=cfg.model_dir,
        hardware_profile=dataclasses.asdict(engine.config.profile),
        versions=versions(),
        controller=kind,
        mode="enforce",
        note=f"{note} {json.dumps({**cell, 'controller': kind})}",
    )
    started = time.perf_counter()
    outcome = serve_recorded(engine, ref.specs, RunSettings(model_dir=cfg.model_dir, seed=cfg.workload.seed), writer)
    metrics: dict[str, Any] = {"wall_s": time.perf_counter() - started}
    metrics.update(timing_metrics(outcome))
    metrics.update(slo_metrics(outcome, cfg.policy))
    metrics.update(byte_metrics(outcome))
    metrics.update(tag_mix(outcome))
    metrics.update(belady_metrics(engine.controller.trace, ref.bytes_per_expert, expert_budget, device))
    metrics["slips"] = float(len(getattr(engine.controller, "slips", [])))
    metrics.update(audit_and_record(engine, outcome, writer, cfg))
    engine.close()
    return {"controller": kind, "run_id": run_id, **cell, "metrics": metrics}


def grid_cells(cfg: SweepConfig, ref: Reference) -> list[dict[str, Any]]:
    """The grid's cells with their budgets in bytes and MiB (expert fraction major order)."""
    cells = []
    for ef in cfg.expert_fracs:
        for kf in cfg.kv_fracs:
            expert, kv = int(ef * ref.expert_bytes_total), max(1, int(kf * ref.peak_kv_bytes))
            cells.append(_cell(ef, kf, expert, kv))
    return cells


def _cell(ef: float, kf: float, expert: int, kv: int) -> dict[str, Any]:
    return {
        "expert_frac": ef,
        "kv_frac": kf,
        "expert_budget_bytes": expert,
        "kv_budget_bytes": kv,
        "expert_budget_mb": round(expert / MIB, 4),
        "kv_budget_mb": round(kv / MIB, 4),
        "device_budget_mb": round((expert + kv) / MIB, 4),
    }


def run_sweep(cfg: SweepConfig, ledger: Ledger, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Reference run, every cell × controller, then the headline comparisons; the whole result as a dict."""
    sweep_id = time.strftime("%Y%m%dT%H%M%S")
    ref = reference_run(cfg)
    log(
        f"reference: {len(ref.specs)} requests, expert bytes {ref.expert_bytes_total / MIB:.2f} MiB "
        f"({ref.bytes_per_expert} B each), peak KV {ref.peak_kv_bytes / MIB:.3f} MiB, "
        f"unpressured TPOT {ref.tpot_ms:.3f} ms measured ({ref.modeled_tpot_ms:.3f} ms modeled)"
    )
    jobs = [(kind, cell) for cell in grid_cells(cfg, ref) for kind in cfg.controllers]
    headline_cell = _headline_cell(cfg, ref)
    if headline_cell is not None:
        extra = [f for f in cfg.static_fracs if not _same_split(f, headline_cell)]
        jobs += [("static_split", {**headline_cell, "static_frac": f}) for f in extra]
    points = []
    for kind, cell in tqdm(jobs, desc="sweep cells", unit="run", disable=not cfg.progress):
        points.append(run_cell(cfg, ref, ledger, kind, cell, f"sweep {sweep_id}"))
    return {
        "sweep_id": sweep_id,
        "model": cfg.model_dir,
        "profile": dataclasses.asdict(hardware_profile(cfg.policy)),
        "workload": cfg.workload.as_dict(),
        "classes": {n: c.model_dump() for n, c in cfg.policy.classes.items()},
        "reference": {k: v for k, v in dataclasses.asdict(ref).items() if k != "specs"},
        "requests": [dataclasses.asdict(s) | {"prompt": s.prompt[:60]} for s in ref.specs],
        "points": [p for p in points if "static_frac" not in p],
        "static_split_at_headline": [p for p in points if "static_frac" in p],
        "headline": headline(points, cfg.headline_expert_frac),
    }


def _headline_cell(cfg: SweepConfig, ref: Reference) -> dict[str, Any] | None:
    cells = [c for c in grid_cells(cfg, ref) if abs(c["expert_frac"] - cfg.headline_expert_frac) < 1e-9]
    return min(cells, key=lambda c: c["kv_frac"]) if cells and cfg.static_fracs else None


def _same_split(frac: float, cell: dict[str, Any]) -> bool:
    return abs(frac - cell["expert_budget_bytes"] / (cell["expert_budget_bytes"] + cell["kv_budget_bytes"])) < 1e-3

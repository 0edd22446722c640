"""The single-workload expert × KV grid that ``python -m fallbackgate.bench.calibration_check`` runs its cells
with (``fallbackgate sweep`` itself is :mod:`fallbackgate.sweep.regime`), and the cell builder's types.

A reference run (exact, unlimited device budget) sizes the grid: expert budgets are fractions of all
routed expert bytes, KV budgets fractions of the workload's peak KV bytes; a cell's device budget is their
sum (``static_split`` gets the cell's expert share as its split). Every cell × controller is one enforce
run recorded to the ledger (``controller`` set, ``note`` = ``sweep <id> {...cell as JSON...}``), audited
against the exact baseline and judged by the gate as ``fallbackgate run`` does. The engines come from a
:data:`CellBuilder` (the command's :func:`fallbackgate.commands.sweep.cell_builder`: the one assembly).
Each run's expert-access trace is recorded (:class:`fallbackgate.sweep.belady.TraceRecorder`) and
Belady's MIN computed on it.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

from tqdm.auto import tqdm

from fallbackgate.batch.prompts import PromptSpec
from fallbackgate.batch.session import RunOutcome, RunSettings, run_prompts
from fallbackgate.controllers import registered_kinds
from fallbackgate.engine.config import MIB
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.tags import Exactness, ObjectKind
from fallbackgate.ledger.db import Ledger
from fallbackgate.ledger.writer import LedgerWriter
from fallbackgate.policy.loader import hardware_profile
from fallbackgate.policy.schema import ControllerKind, Policy
from fallbackgate.recording import RunRecorder
from fallbackgate.sweep.belady import belady_misses, lru_misses
from fallbackgate.sweep.metrics import headline, quality_metrics, slo_metrics, tag_mix, timing_metrics
from fallbackgate.sweep.workload import WorkloadSpec, build_workload

CONTROLLERS: tuple[str, ...] = tuple(k.value for k in registered_kinds())


@dataclasses.dataclass(slots=True)
class SweepConfig:
    """What to sweep: model, policy (classes, SLOs, budgets, hardware), grid, controllers, workload."""

    model_dir: str
    policy: Policy
    policy_name: str = "sweep"  # the policy file's stem (the run rows name it)
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


class Assembled(Protocol):
    """What the sweep needs of an assembled engine (:class:`fallbackgate.assembly.Assembly` is one)."""

    engine: Engine
    settings: RunSettings

    def recorder(self, writer: LedgerWriter, note: str = "") -> RunRecorder: ...


# (controller kind, device budget in bytes (None: unlimited), static split's expert share, ledger whose
# calibrations the joint controller predicts with) -> an enforce-mode engine serving the sweep's policy,
# its controller wrapped in a TraceRecorder
CellBuilder = Callable[[str, int | None, float, Ledger | None], Assembled]


def reference_run(cfg: SweepConfig, build: CellBuilder) -> Reference:
    """Exact, unlimited device budget: peak KV bytes, expert sizes, the trace length, unpressured TPOT."""
    built = build(ControllerKind.EXACT_LRU.value, None, 0.5, None)
    engine = built.engine
    specs = build_workload(cfg.workload, engine.tokenizer)
    outcome = run_prompts(engine, specs, built.settings, None, False)
    memory = outcome.memory
    tpots = [o.modeled_tpot_s for o in outcome.outputs if len(o.output_token_ids) > 1]
    measured = [o.tpot_s for o in outcome.outputs if len(o.output_token_ids) > 1]
    return Reference(
        specs,
        memory["bytes_per_expert"],
        memory["expert_bytes_total"],
        max(s.num_device_bytes_kv for s in outcome.steps),
        int(getattr(engine.model_config, "num_experts_per_tok", None) or 1),
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


def run_cell(
    cfg: SweepConfig, ref: Reference, ledger: Ledger, kind: str, cell: dict[str, Any], note: str, build: CellBuilder
) -> dict:
    """One recorded, audited and judged run of controller ``kind`` in ``cell``; returns the sweep point."""
    expert_budget, kv_budget = cell["expert_budget_bytes"], cell["kv_budget_bytes"]
    device = expert_budget + kv_budget
    split = cell.get("static_frac") or min(0.99, max(0.01, expert_budget / device))
    built = build(kind, device, split, ledger)
    engine = built.engine
    recorder = built.recorder(LedgerWriter(ledger), note=f"{note} {json.dumps({**cell, 'controller': kind})}")
    started = time.perf_counter()
    outcome = recorder.serve(ref.specs, built.settings)
    metrics: dict[str, Any] = {"wall_s": time.perf_counter() - started}
    metrics.update(timing_metrics(outcome))
    metrics.update(slo_metrics(outcome, cfg.policy))
    metrics.update(byte_metrics(outcome))
    metrics.update(tag_mix(outcome))
    metrics.update(belady_metrics(engine.controller.trace, ref.bytes_per_expert, expert_budget, device))
    metrics["slips"] = float(len(getattr(engine.controller, "slips", [])))
    verdict = recorder.finish(outcome)
    metrics.update(quality_metrics(recorder.audited_stats, verdict))
    engine.close()
    return {"controller": kind, "run_id": recorder.run_id, **cell, "metrics": metrics}


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


def run_sweep(
    cfg: SweepConfig, ledger: Ledger, build: CellBuilder, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Reference run, every cell × controller (engines from ``build``), then the headline comparisons; the
    whole result as a dict."""
    sweep_id = time.strftime("%Y%m%dT%H%M%S")
    ref = reference_run(cfg, build)
    log(
        f"reference: {len(ref.specs)} requests, expert bytes {ref.expert_bytes_total / MIB:.2f} MiB "
        f"({ref.bytes_per_expert} B each), peak KV {ref.peak_kv_bytes / MIB:.3f} MiB, "
        f"unpressured TPOT {ref.tpot_ms:.3f} ms measured ({ref.modeled_tpot_ms:.3f} ms modeled)"
    )
    jobs = [(kind, cell) for cell in grid_cells(cfg, ref) for kind in cfg.controllers]
    headline_cell = _headline_cell(cfg, ref)
    if headline_cell is not None:
        extra = [f for f in cfg.static_fracs if not _same_split(f, headline_cell)]
        jobs += [(ControllerKind.STATIC_SPLIT.value, {**headline_cell, "static_frac": f}) for f in extra]
    points = []
    for kind, cell in tqdm(jobs, desc="sweep cells", unit="run", disable=not cfg.progress):
        points.append(run_cell(cfg, ref, ledger, kind, cell, f"sweep {sweep_id}", build))
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

"""The budget sweep in the RAM-and-disk regime: the probe's workloads from seeds, RAM budget × KV share.

For each workload kind (``fallbackgate workload``'s generators, bundled passages only, so a seed gives the
same requests everywhere) and seed, every controller serves the same requests at their arrival times (scaled
by ``time_scale``) under a binding RAM budget: a fraction of the workload's demand (all routed experts plus
the KV every request would hold at its full length). ``static_split`` runs at each KV share (its expert
share is 1 − KV share); ``independent_lru`` (the probe's two simple controllers: one LRU per kind, KV
evicting KV first) and ``joint`` run once per budget, in an order rotated by the seed (:func:`grid`).
Experts are read from the checkpoint on disk, KV spills to disk. Every run is a ledger run, audited against
the exact baseline and gated, and writes a trace (format v1) from which miss rates, stalls, I/O bytes by tier
and the offline bounds come (:mod:`fallbackgate.sweep.bounds`). SLO targets are set per kind from one
all-in-RAM run on the first seed (``slo_scale`` × its p50 TTFT and TPOT), never from the held-out seed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from fallbackgate.assembly import Assembly, Overrides, assemble
from fallbackgate.batch.prompts import PromptSpec
from fallbackgate.ledger import queries
from fallbackgate.ledger.db import Ledger
from fallbackgate.ledger.writer import LedgerWriter
from fallbackgate.policy.apply import with_sections
from fallbackgate.policy.schema import ControllerKind, ExpertAdmission, Policy, StepTime
from fallbackgate.sweep import bounds, measures
from fallbackgate.sweep.metrics import quality_metrics
from fallbackgate.sweep.workload import BEST_EFFORT, STRICT, default_policy
from fallbackgate.tracing.reader import read_trace
from fallbackgate.workloads.build import generate, prompt_specs
from fallbackgate.workloads.kinds import Context, WorkloadKind
from fallbackgate.workloads.text import TextPool
from fallbackgate.workloads.tokens import ModelTokens, length_limit

STATIC, INDEPENDENT, JOINT = (ControllerKind.STATIC_SPLIT.value, ControllerKind.INDEPENDENT_LRU.value,
                              ControllerKind.JOINT.value)  # fmt: skip
KEEP_ALL = "all"  # keep_traces: every cell's trace


@dataclasses.dataclass(slots=True)
class RegimeConfig:
    """What the sweep runs."""

    model_dir: str
    workloads: tuple[str, ...] = tuple(k.value for k in WorkloadKind)
    seeds: tuple[int, ...] = (0, 1, 2)
    held_out_seed: int = 2  # reported apart; nothing (SLOs included) is set from it
    num_requests: int = 5
    mixed_requests: int = 8  # mixed needs enough requests for its phases
    max_new_tokens: int = 256  # cap on every answer: half the 512-token limit keeps each workload's own lengths
    max_model_len: int = 512  # the length limit the workloads' fractions refer to
    time_scale: float = 0.25  # arrival times are multiplied by this
    ram_fracs: tuple[float, ...] = (0.25, 0.5)  # RAM budget as a fraction of experts + KV demand
    kv_shares: tuple[float, ...] = (0.1, 0.3, 0.5)  # static_split's KV share of the RAM budget
    controllers: tuple[str, ...] = (STATIC, INDEPENDENT, JOINT)
    slo_scale: float = 1.5  # SLO targets: this × the all-in-RAM run's p50 TTFT / TPOT (strict; best-effort 2×)
    step_time: str = StepTime.MODELED.value  # controller.step_time for every controller (StepTime)
    expert_admission: str = ExpertAdmission.EXACT.value  # controller.expert_admission (joint alone reads it)
    class_budgets: dict[str, dict[str, Any]] | None = None  # fields replaced in the classes' quality budgets
    audit_rate: float = 1.0
    is_equivalent_allowed: bool = True  # baselines may serve late misses with the equivalent tags joint uses
    keep_traces: tuple[str, ...] = ()  # cell_key()s of the cells whose trace is kept (KEEP_ALL: every cell's)
    trace_out: str | None = None  # where kept traces go
    lowbit_dir: str | None = None  # memory.lowbit_dir of every cell: low-bit expert copies prepared once there
    # per kind, an earlier sweep's SLO reference (its sweep.json "slo_references"): its targets are used and no
    # reference is run, so a rerun of some controllers is measured against the same targets as the sweep it joins
    slo_from: dict[str, dict[str, Any]] | None = None
    max_num_seqs: int = 8  # memory.max_num_seqs: requests decoded together at most
    # "<workload>/<seed>" -> the bytes ram_fracs are fractions of, from another sweep (its own demand: the same
    # RAM bytes for another model or workload size); None: this sweep's own demand
    ram_basis: dict[str, int] | None = None


class SweepInputError(ValueError):
    """The sweep cannot run as asked (an earlier sweep's reference that does not fit); the message says why."""


def cell_key(cell: dict[str, Any]) -> str:
    """``<workload>/<seed>/<controller>/<ram_frac>/<kv_share>`` (kv_share ``None`` outside static_split)."""
    return f"{cell['workload']}/{cell['seed']}/{cell['controller']}/{cell['ram_frac']}/{cell['kv_share']}"


def trace_label(cell: dict[str, Any]) -> str:
    """A traced cell's name: workload, controller and (static_split) KV share, e.g. ``mixed_static_split_kv0.3``."""
    share = "" if cell["kv_share"] is None else f"_kv{cell['kv_share']:g}"
    return f"{cell['workload']}_{cell['controller']}{share}"


def workload_specs(cfg: RegimeConfig, kind: str, seed: int) -> list[PromptSpec]:
    """The requests of ``kind`` from ``seed``: answers capped, arrivals scaled, classes drawn from the seed."""
    tokens = ModelTokens(cfg.model_dir)
    limit = length_limit(cfg.model_dir, cfg.max_model_len).tokens
    ctx = Context(tokens, TextPool.load(tokens, None), limit)
    n = cfg.mixed_requests if kind == WorkloadKind.MIXED.value else cfg.num_requests
    specs = prompt_specs(generate(ctx, WorkloadKind(kind), seed, n, None))
    rng = random.Random(f"fallbackgate-sweep-classes:{kind}:{seed}")
    return [
        dataclasses.replace(
            s,
            request_class=STRICT if rng.random() < 0.5 else BEST_EFFORT,
            max_new_tokens=min(cfg.max_new_tokens, s.max_new_tokens or cfg.max_new_tokens),
            arrival_s=round((s.arrival_s or 0.0) * cfg.time_scale, 6),
        )
        for s in specs
    ]


def build(cfg: RegimeConfig, policy: Policy, kind: str, ram: int | None, split: float, trace: str | None) -> Assembly:
    """An enforce-mode engine with controller ``kind`` under ``ram`` bytes (None: sized from memory)."""
    memory = {"device_budget_mb": None, "lowbit_dir": cfg.lowbit_dir}
    merged = with_sections(policy, {"controller": {"kind": kind}, "memory": memory}, cfg.model_dir)
    overrides = Overrides(
        max_new_tokens=cfg.max_new_tokens,
        device_budget_bytes=ram,
        expert_fraction=split,
        is_equivalent_allowed=cfg.is_equivalent_allowed,
        max_model_len=cfg.max_model_len,
        trace_dir=trace,
    )
    return assemble(merged, overrides, policy_name="sweep")


def geometry(assembly: Assembly) -> dict[str, int]:
    """What the demand of a workload is computed from: expert bytes, KV block size, layers and bytes."""
    engine, kv = assembly.engine, assembly.engine.kv_store
    return {"expert_bytes": int(engine.expert_store.bytes_per_expert * len(engine.expert_store.entries)),
            "block_size": int(kv.block_size), "num_layers": int(kv.num_layers),
            "bytes_per_kv_block": int(kv.bytes_per_block)}  # fmt: skip


def kv_demand_bytes(cfg: RegimeConfig, shape: dict[str, int], specs: list[PromptSpec]) -> int:
    """KV bytes of every request at its full length (prompt + answer), as if all were held at once."""
    tokens = ModelTokens(cfg.model_dir)
    blocks = sum(math.ceil((tokens.count(s.prompt) + (s.max_new_tokens or 0)) / shape["block_size"]) for s in specs)
    return blocks * shape["num_layers"] * shape["bytes_per_kv_block"]


def sweep_policy(cfg: RegimeConfig, kind: str, ledger: Ledger) -> tuple[Policy, dict[str, Any]]:
    """The kind's policy: SLO targets from one all-in-RAM exact run of its first seed's requests, or the
    earlier sweep's (`cfg.slo_from`: its reference, kept with ``"reused": True``)."""
    built = build(cfg, default_policy(max_num_seqs=cfg.max_num_seqs), ControllerKind.EXACT_LRU.value, None, 0.5, None)
    if cfg.slo_from is not None:
        return _reused_policy(cfg, kind, built)
    specs = workload_specs(cfg, kind, cfg.seeds[0])
    recorder = built.recorder(LedgerWriter(ledger), note=f"sweep {kind} slo-reference seed {cfg.seeds[0]}")
    outcome = recorder.serve(specs, built.settings)
    recorder.finish(outcome)
    ref = measures.latency_measures(outcome, built.policy)
    shape = geometry(built)
    built.engine.close()
    tpot, ttft = max(ref["tpot_p50_ms"], 1.0), max(ref["ttft_p50_ms"], 1.0)
    strict = (cfg.slo_scale * tpot, cfg.slo_scale * ttft)
    best = (2 * cfg.slo_scale * tpot, 2 * cfg.slo_scale * ttft)
    policy = _targets_policy(cfg, (strict[0], best[0]), (strict[1], best[1]))
    info = {"reference": ref, "slo_tpot_ms": [strict[0], best[0]], "slo_ttft_ms": [strict[1], best[1]],
            "geometry": shape, "run_id": recorder.run_id}  # fmt: skip
    return policy, info


def _reused_policy(cfg: RegimeConfig, kind: str, built: Assembly) -> tuple[Policy, dict[str, Any]]:
    assert cfg.slo_from is not None
    shape = geometry(built)
    built.engine.close()
    info = cfg.slo_from.get(kind)
    if info is None:
        raise SweepInputError(f"the sweep the SLO targets come from has no {kind!r} reference")
    if info.get("geometry") != shape:
        raise SweepInputError(f"{kind}: the earlier sweep's geometry {info.get('geometry')} is not this one's {shape}")
    tpot, ttft = (tuple(info[f"slo_{m}_ms"]) for m in ("tpot", "ttft"))  # (strict, best-effort) each
    return _targets_policy(cfg, tpot, ttft), {**info, "reused": True}


def _targets_policy(cfg: RegimeConfig, tpot_ms: tuple[float, float], ttft_ms: tuple[float, float]) -> Policy:
    """The sweep's policy at these (strict, best-effort) targets with `cfg`'s controller settings and budgets."""
    return default_policy(
        tpot_ms=tpot_ms,
        ttft_ms=ttft_ms,
        step_time=cfg.step_time,
        expert_admission=cfg.expert_admission,
        class_budgets=cfg.class_budgets,
        max_num_seqs=cfg.max_num_seqs,
    )


def run_cell(cfg: RegimeConfig, policy: Policy, specs: list[PromptSpec], cell: dict[str, Any], ledger: Ledger) -> dict:
    """One recorded, audited, gated and traced run; returns the point with its measures and bounds."""
    ram, kind = cell["ram_bytes"], cell["controller"]
    split = 1.0 - cell["kv_share"] if cell.get("kv_share") is not None else 0.5
    scratch = tempfile.mkdtemp(prefix="fg-sweep-")
    trace_dir = str(pathlib.Path(scratch) / trace_label(cell))  # the trace's workload name: the report's sections
    try:
        built = build(cfg, policy, kind, ram, split, trace_dir)
        recorder = built.recorder(LedgerWriter(ledger), note=f"sweep {cell['workload']} seed {cell['seed']} {kind}")
        kernel_before = measures.proc_io()["read_bytes"]
        measures.reset_peak_rss()  # a sweep runs many cells in one process: this cell's peak, not the run's
        outcome = recorder.serve(specs, built.settings)
        kernel_read = measures.proc_io()["read_bytes"] - kernel_before  # serving only: the audit reads too
        peak_rss_serve = measures.peak_rss_bytes()
        verdict = recorder.finish(outcome)
        m: dict[str, Any] = measures.latency_measures(outcome, built.policy)
        m["kernel_read_bytes_serve"] = float(kernel_read)
        m["peak_rss_serve_bytes"] = float(peak_rss_serve)
        m.update(measures.tag_bytes(outcome))
        m["read_bytes"] = measures.read_bytes_of(m)
        m.update(quality_metrics(recorder.audited_stats, verdict))
        m["load_avg_1m"] = os.getloadavg()[0]
        m["peak_pool_by_kind"] = outcome.memory.get("peak_device_pool_bytes_by_kind", {})
        trace = read_trace(trace_dir)
        experts, kv, io = (trace.frame(t) for t in ("expert_access", "kv_access", "io"))
        m.update(measures.trace_measures(experts, kv, io))
        model = trace.metadata["model"]
        steps = bounds.step_trace(experts, kv, model["bytes_per_expert"], model["bytes_per_kv_block"])
        m.update(_bounds(steps, ram, cell, m))
        m.update(bounds.belady_expert_at_room(steps, queries.expert_room_by_step(ledger, recorder.run_id)))
        built.engine.close()
        key = cell_key(cell)
        if cfg.trace_out and (key in cfg.keep_traces or KEEP_ALL in cfg.keep_traces):
            target = pathlib.Path(cfg.trace_out) / key.replace("/", "_")
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(trace_dir, target)
            cell = {**cell, "trace": str(target)}
        return {**cell, "run_id": recorder.run_id, "metrics": m}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _bounds(steps: bounds.StepTrace, ram: int, cell: dict[str, Any], m: dict[str, Any]) -> dict[str, float]:
    """Belady's MIN per kind at the run's split (static: its own; others: the experts' peak pool share) and
    FOO's LP bound for the shared budget."""
    if cell.get("kv_share") is not None:
        expert_room = int(ram * (1.0 - cell["kv_share"]))
    else:
        expert_room = int(min(ram, m["peak_pool_by_kind"].get("expert", ram)))
    out = bounds.belady_by_kind(steps, expert_room, ram - expert_room)
    out["belady_split_expert_share"] = expert_room / ram
    out.update(bounds.foo_lower_bound(steps, ram))
    return out


def grid(cfg: RegimeConfig, kind: str, seed: int, demand: int) -> list[dict[str, Any]]:
    """The cells of one workload and seed, per RAM budget the controllers in an order rotated by the seed
    (``seed mod`` their number: seed 0 the first controller first, seed 1 the second, ...), so that none runs
    first or last in every seed (a static split's KV shares stay together). A budget is its fraction of
    `demand`, or of ``cfg.ram_basis``'s bytes for the workload and seed (then named in ``ram_basis_bytes``;
    ``is_binding`` is false where that holds the whole demand)."""
    shift = seed % len(cfg.controllers) if cfg.controllers else 0
    controllers = cfg.controllers[shift:] + cfg.controllers[:shift]
    basis = {} if cfg.ram_basis is None else {"ram_basis_bytes": cfg.ram_basis[f"{kind}/{seed}"]}
    of = basis.get("ram_basis_bytes", demand)
    cells = []
    for frac in cfg.ram_fracs:
        base = {"workload": kind, "seed": seed, "is_held_out": seed == cfg.held_out_seed, "ram_frac": frac,
                "ram_bytes": int(frac * of), "demand_bytes": demand, "is_binding": int(frac * of) < demand,
                **basis}  # fmt: skip
        for controller in controllers:
            shares = cfg.kv_shares if controller == STATIC else (None,)
            cells += [{**base, "controller": controller, "kv_share": share} for share in shares]
    return cells


def run_regime(cfg: RegimeConfig, ledger: Ledger, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every workload × seed × cell; the points and each kind's SLO reference."""
    points, references = [], {}
    started = time.perf_counter()
    if cfg.trace_out:
        pathlib.Path(cfg.trace_out).mkdir(parents=True, exist_ok=True)
    for kind in cfg.workloads:
        policy, info = sweep_policy(cfg, kind, ledger)
        references[kind] = info
        for seed in cfg.seeds:
            specs = workload_specs(cfg, kind, seed)
            kv = kv_demand_bytes(cfg, info["geometry"], specs)
            for cell in grid(cfg, kind, seed, info["geometry"]["expert_bytes"] + kv):
                point = run_cell(cfg, policy, specs, {**cell, "kv_demand_bytes": kv}, ledger)
                points.append(point)
                if cfg.trace_out:  # progress on disk: a run cut short keeps its points
                    partial = pathlib.Path(cfg.trace_out).parent / "sweep.partial.json"
                    partial.write_text(json.dumps({"points": points, "slo_references": references}, indent=1))
                m = point["metrics"]
                log(f"[{time.perf_counter() - started:6.0f}s] {kind} s{seed} {cell['controller']:15s} "
                    f"ram {cell['ram_frac']} kv {cell['kv_share']}: tpot p99 {m['tpot_p99_ms']:.1f} ms "
                    f"slo {m['slo_attainment']:.2f} read {m['read_bytes'] / 2**20:.1f} MiB "
                    f"foo {m['foo_lb_bytes'] / 2**20:.1f} MiB kl {m['mean_kl']:.1e}"
                    + ("" if cell["is_binding"] else " (not binding: RAM holds the whole demand)"))  # fmt: skip
    return {"points": points, "slo_references": references, "config": dataclasses.asdict(cfg),
            "elapsed_s": time.perf_counter() - started}  # fmt: skip

"""Per-run metrics of a sweep point (modeled latency, SLO attainment, tag mix, measured quality) and the
headline comparisons (joint vs Belady's MIN, joint vs the best static split)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from fallbackgate.audit.gate import RunVerdict
from fallbackgate.audit.stats import RequestDiffStats
from fallbackgate.batch.session import RunOutcome
from fallbackgate.engine.tags import Tag
from fallbackgate.policy.schema import ControllerKind, Policy

EXACT_CONTROLLERS = (ControllerKind.EXACT_LRU, ControllerKind.INDEPENDENT_LRU, ControllerKind.STATIC_SPLIT)
"""The exact-only controllers whose trace Belady's MIN is computed on, first found first."""


def p99(values: Sequence[float]) -> float:
    """Nearest-rank 99th percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def timing_metrics(outcome: RunOutcome) -> dict[str, float]:
    """TPOT and TTFT per request, mean and p99 in milliseconds: measured wall clock (``tpot_*``, ``ttft_*``,
    the run's ``wall_ms``) and the profile's modeled what-if (``modeled_*``)."""
    decoding = [o for o in outcome.outputs if len(o.output_token_ids) > 1]
    measured_tpot = [1000 * o.tpot_s for o in decoding]
    measured_ttft = [1000 * o.ttft_s for o in outcome.outputs]
    tpot = [1000 * o.modeled_tpot_s for o in decoding]
    ttft = [1000 * o.modeled_ttft_s for o in outcome.outputs]
    return {
        "tpot_mean_ms": _mean(measured_tpot),
        "tpot_p99_ms": p99(measured_tpot),
        "ttft_mean_ms": _mean(measured_ttft),
        "ttft_p99_ms": p99(measured_ttft),
        "wall_ms": 1000 * outcome.wall_s,
        "modeled_tpot_mean_ms": _mean(tpot),
        "modeled_tpot_p99_ms": p99(tpot),
        "modeled_ttft_mean_ms": _mean(ttft),
        "modeled_ttft_p99_ms": p99(ttft),
        "modeled_total_ms": 1000 * sum(s.modeled_s for s in outcome.steps),
    }


def slo_metrics(outcome: RunOutcome, policy: Policy) -> dict[str, float]:
    """Fraction of requests meeting their class's TTFT and TPOT targets in measured wall clock, overall and
    per class; ``slo_attainment_modeled`` is the same against the profile's modeled what-if."""
    met: dict[str, list[bool]] = {}
    modeled: list[bool] = []
    for spec, out in zip(outcome.specs, outcome.outputs, strict=True):
        slo = policy.classes[spec.request_class].slo
        is_met = out.ttft_s * 1e3 <= slo.ttft_ms and out.tpot_s * 1e3 <= slo.tpot_ms
        met.setdefault(spec.request_class, []).append(is_met)
        modeled.append(out.modeled_ttft_s * 1e3 <= slo.ttft_ms and out.modeled_tpot_s * 1e3 <= slo.tpot_ms)
    everything = [ok for oks in met.values() for ok in oks]
    result = {"slo_attainment": _mean([float(ok) for ok in everything])}
    for name, oks in met.items():
        result[f"slo_attainment_{name.replace('-', '_')}"] = _mean([float(ok) for ok in oks])
    result["slo_attainment_modeled"] = _mean([float(ok) for ok in modeled])
    return result


def tag_mix(outcome: RunOutcome) -> dict[str, float]:
    """Share of objects served with each non-resident tag (``tag_<name>``), over all objects served."""
    counts: Counter[str] = Counter()
    for out in outcome.outputs:
        counts.update(out.tag_counts)
    total = sum(counts.values()) or 1
    tags = [t.value for t in Tag if t is not Tag.RESIDENT]
    return {f"tag_{t}": counts.get(t, 0) / total for t in tags}


def quality_metrics(stats: Sequence[RequestDiffStats], verdict: RunVerdict) -> dict[str, float]:
    """Measured quality over the audited requests and the gate's verdict."""
    failed = sum(1 for r in verdict.requests if not r.passed)
    return {
        "mean_kl": _mean([s.mean_kl for s in stats]),
        "max_p99_kl": max((s.p99_kl for s in stats), default=0.0),
        "max_kl": max((s.max_kl for s in stats), default=0.0),
        "top1_agreement": _mean([s.top1_agreement for s in stats]),
        "ppl_ratio": _mean([s.ppl_ratio for s in stats]),
        "num_audited": float(len(stats)),
        "gate_failed_requests": float(failed),
        "gate_passed": float(verdict.passed),
    }


def _at(points: list[dict[str, Any]], controller: ControllerKind, expert_frac: float) -> dict[str, Any] | None:
    """The grid point of ``controller`` at ``expert_frac`` with the smallest KV fraction."""
    found = [
        p
        for p in points
        if p["controller"] == controller and abs(p["expert_frac"] - expert_frac) < 1e-9 and "static_frac" not in p
    ]
    return min(found, key=lambda p: p["kv_frac"]) if found else None


def headline(points: list[dict[str, Any]], expert_frac: float) -> dict[str, Any]:
    """Joint's exact expert bytes over Belady's MIN and joint's measured TPOT against the best static split
    (by measured TPOT; the modeled what-if's gain is reported beside it)."""
    joint = _at(points, ControllerKind.JOINT, expert_frac)
    if joint is None:
        return {"note": f"no joint run at expert fraction {expert_frac}"}
    m = joint["metrics"]
    out: dict[str, Any] = {"expert_frac": expert_frac, "kv_frac": joint["kv_frac"], "joint_run_id": joint["run_id"]}
    out["device_budget_mb"] = joint["device_budget_mb"]
    out["joint_expert_exact_bytes"] = m["expert_exact_bytes"]
    out["belady_bytes_joint_trace"] = m["belady_expert_bytes"]
    exact = next((_at(points, c, expert_frac) for c in EXACT_CONTROLLERS if _at(points, c, expert_frac)), None)
    if exact is not None:
        out["exact_trace_from"] = exact["controller"]
        out["belady_bytes_exact_trace"] = exact["metrics"]["belady_expert_bytes"]
        out["belady_bytes_exact_trace_all_slots"] = exact["metrics"]["belady_expert_bytes_all_slots"]
        out["joint_over_belady"] = m["expert_exact_bytes"] / max(1.0, exact["metrics"]["belady_expert_bytes"])
    statics = [
        p
        for p in points
        if p["controller"] == ControllerKind.STATIC_SPLIT
        and abs(p["device_budget_mb"] - joint["device_budget_mb"]) < 1e-6
    ]
    if statics:
        best = min(statics, key=lambda p: p["metrics"]["tpot_mean_ms"])
        split = best.get("static_frac") or best["expert_budget_bytes"] / (
            best["expert_budget_bytes"] + best["kv_budget_bytes"]
        )
        out["best_static_split_expert_share"] = round(split, 3)
        out["best_static_tpot_ms"] = best["metrics"]["tpot_mean_ms"]
        out["joint_tpot_ms"] = m["tpot_mean_ms"]
        out["joint_tpot_gain"] = 1 - m["tpot_mean_ms"] / max(1e-12, best["metrics"]["tpot_mean_ms"])
        best_modeled = min(p["metrics"]["modeled_tpot_mean_ms"] for p in statics)
        out["joint_modeled_tpot_gain"] = 1 - m["modeled_tpot_mean_ms"] / max(1e-12, best_modeled)
        out["best_static_slo_attainment"] = best["metrics"]["slo_attainment"]
        out["joint_slo_attainment"] = m["slo_attainment"]
    return out

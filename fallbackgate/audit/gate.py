"""The gate: a verdict per request and per run, from the ledger's diff statistics and events.

A request fails when its measured statistics break its quality budget (``max_mean_kl``,
``max_p99_kl``, ``min_top1_agreement``, ``max_approx_fraction``, ``allowed_tags``: the approximate
tags it may use; exact and equivalent tags are always allowed), or when it was served only through
exact- and equivalent-class tags and still differs from the exact baseline by more than the numeric
tolerance — a correctness bug, not a trade-off:

- exact tags only: ``max(FLOOR_MARGIN × numeric floor, EXACT_TOLERANCE_MIN)`` nats of max KL, where
  the numeric floor is the max KL of the run's exact-vs-exact control (``runs.numeric_floor_kl``);
- with equivalent tags (``cpu_execute``, ``recompute``): ``max(EQUIVALENT_FLOOR_MARGIN × floor,
  EQUIVALENT_TOLERANCE)`` nats.
  Exact and equivalent paths (same math, other kernel or order) measure at the numeric floor (~1e-14
  nats on CPU); 1e-9 nats leaves five orders of magnitude for kernel differences and still catches
  lost precision (bf16 weights inside ``cpu_execute`` move KL by ~1e-8). Where the floor is higher
  (other hardware), the tolerances scale with the measured floor.

Approximate tags recorded on observe steps were not applied, so they do not count as served.
A run passes when it finished and all its requests pass. Failing verdicts name the first diverging
position, the step that produced it, the lowest layer with a non-exact tag on that step and its tags.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from fallbackgate.engine.tags import TAG_EXACTNESS, Exactness, Tag
from fallbackgate.ledger import queries
from fallbackgate.ledger.db import Ledger, LedgerError
from fallbackgate.ledger.writer import LedgerWriter

EXACT_TOLERANCE_MIN = 1e-9
FLOOR_MARGIN = 10.0
EQUIVALENT_TOLERANCE = 1e-9
EQUIVALENT_FLOOR_MARGIN = 1000.0


@dataclasses.dataclass
class RequestVerdict:
    """The gate's verdict on one request."""

    request_id: str
    passed: bool
    served: str  # strongest exactness class it was served with: exact, equivalent or approximate
    reasons: list[str] = dataclasses.field(default_factory=list)
    correctness_bug: bool = False
    position: int | None = None  # first diverging output position
    step: int | None = None  # step that produced that position
    layer: int | None = None  # lowest layer with a non-exact tag on that step
    tags: list[str] = dataclasses.field(default_factory=list)  # tags on that step for this request
    stats: dict[str, Any] | None = None

    @property
    def reason(self) -> str:
        """All reasons in one line ("ok" when it passed)."""
        return "; ".join(self.reasons) if self.reasons else "ok"


@dataclasses.dataclass
class RunVerdict:
    """The gate's verdict on a run: passes when the run finished and every request passed."""

    run_id: int
    passed: bool
    status: str
    reasons: list[str]
    requests: list[RequestVerdict]


def tolerance(served: str, numeric_floor_kl: float | None) -> float:
    """Max KL allowed for a request served with exactness class ``served`` (inf for approximate)."""
    exact = max(FLOOR_MARGIN * (numeric_floor_kl or 0.0), EXACT_TOLERANCE_MIN)
    if served == "exact":
        return exact
    if served == "equivalent":
        return max(EQUIVALENT_TOLERANCE, EQUIVALENT_FLOOR_MARGIN * (numeric_floor_kl or 0.0), exact)
    return float("inf")


def served_class(objects_by_class: Mapping[str, int]) -> str:
    """The least exact class with any objects served (exact when there were no events)."""
    for cls in ("approximate", "equivalent"):
        if objects_by_class.get(cls, 0) > 0:
            return cls
    return "exact"


def judge_request(
    request_id: str,
    stats: Mapping[str, Any] | None,
    budget: Mapping[str, Any] | None,
    objects_by_class: Mapping[str, int],
    objects_by_tag: Mapping[str, int],
    numeric_floor_kl: float | None,
) -> RequestVerdict:
    """Judge one request from its diff statistics (None when not audited), budget and tag counts."""
    served = served_class(objects_by_class)
    v = RequestVerdict(request_id, True, served, stats=dict(stats) if stats is not None else None)
    budget = budget or {}
    if stats is not None:
        _check_kl_budget(v, stats, budget)
        tol = tolerance(served, numeric_floor_kl)
        if stats["max_kl"] > tol:
            v.correctness_bug = True
            v.reasons.insert(
                0,
                f"correctness bug: served {served}-only but max KL {stats['max_kl']:.3g} > {tol:.3g}",
            )
    total = sum(objects_by_class.values())
    approx = objects_by_class.get("approximate", 0)
    limit = budget.get("max_approx_fraction")
    if limit is not None and total and approx / total > limit:
        v.reasons.append(f"approximate fraction {approx / total:.3g} > {limit:g}")
    allowed = budget.get("allowed_tags")
    if allowed is not None:
        used = sorted(t for t, n in objects_by_tag.items() if n > 0 and _is_approximate(t) and t not in allowed)
        if used:
            v.reasons.append(f"tags not allowed: {', '.join(used)}")
    v.passed = not v.reasons
    return v


def _is_approximate(tag: str) -> bool:
    try:
        return TAG_EXACTNESS[Tag(tag)] is Exactness.APPROXIMATE
    except ValueError:
        return True  # an unknown tag is never assumed exact


def _check_kl_budget(v: RequestVerdict, stats: Mapping[str, Any], budget: Mapping[str, Any]) -> None:
    checks = (
        ("max_mean_kl", "mean_kl", "mean KL", 1),
        ("max_p99_kl", "p99_kl", "p99 KL", 1),
        ("min_top1_agreement", "top1_agreement", "top-1 agreement", -1),
    )
    for key, stat, label, sign in checks:
        limit = budget.get(key)
        if limit is not None and sign * stats[stat] > sign * limit:
            op = ">" if sign > 0 else "<"
            v.reasons.append(f"{label} {stats[stat]:.3g} {op} budget {limit:g}")


def _locate(ledger: Ledger, run_id: int, v: RequestVerdict, numeric_floor_kl: float | None) -> None:
    """Fill in the first diverging position, its step, layer and tags."""
    diffs = queries.position_diffs(ledger, run_id, v.request_id)
    if not diffs:
        return
    tol = tolerance(v.served, numeric_floor_kl)
    first = next((d for d in diffs if d["kl"] > tol), None) if v.correctness_bug else None
    first = first or next((d for d in diffs if not d["top1_agree"]), None)
    first = first or max(diffs, key=lambda d: d["kl"])
    v.position, v.step = first["position"], first["step_id"]
    if v.step is None:
        return
    events = queries.request_events(ledger, run_id, v.request_id, step_id=v.step)
    v.tags = sorted({e["tag"] for e in events})
    non_exact = [e["layer"] for e in events if e["exactness"] != "exact"]
    layers = non_exact or [e["layer"] for e in events]
    v.layer = min(layers) if layers else None


def evaluate_run(ledger: Ledger, run_id: int) -> RunVerdict:
    """Judge every request of ``run_id`` and the run; raise LedgerError when the run does not exist."""
    run = queries.get_run(ledger, run_id)
    if run is None:
        raise LedgerError(f"no run {run_id} in ledger {ledger.display_url}")
    floor = run["numeric_floor_kl"]
    by_class = queries.request_exactness(ledger, run_id)
    by_tag = queries.request_tags(ledger, run_id)
    verdicts = []
    stat_keys = (
        "num_positions",
        "mean_kl",
        "median_kl",
        "p99_kl",
        "max_kl",
        "top1_agreement",
        "first_divergence",
    )
    for req in queries.request_summaries(ledger, run_id):
        rid = req["request_id"]
        stats = {k: req[k] for k in stat_keys} if req["num_positions"] is not None else None
        v = judge_request(rid, stats, req["budget"], by_class.get(rid, {}), by_tag.get(rid, {}), floor)
        if not v.passed:
            _locate(ledger, run_id, v, floor)
        verdicts.append(v)
    reasons = []
    if run["status"] != "complete":
        reasons.append(f"run is {run['status']}")
    failed = [v.request_id for v in verdicts if not v.passed]
    if failed:
        reasons.append(f"{len(failed)} of {len(verdicts)} requests failed: {', '.join(failed[:10])}")
    return RunVerdict(run_id, not reasons, run["status"], reasons, verdicts)


def record_verdicts(writer: LedgerWriter, verdict: RunVerdict) -> None:
    """Write every request's verdict and the run's verdict into the ledger (queued on `writer`)."""
    for v in verdict.requests:
        writer.record_verdict(
            v.request_id,
            v.passed,
            v.reason,
            position=v.position,
            step=v.step,
            layer=v.layer,
            tags=v.tags,
            run_id=verdict.run_id,
        )
    writer.record_verdict(None, verdict.passed, "; ".join(verdict.reasons) or "ok", run_id=verdict.run_id)

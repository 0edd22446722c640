"""The gate: a verdict per request and per run, from the ledger's diff statistics and events.

Everything is measured against the run's exact-vs-exact control (``runs.numeric_floor``: one prefill
pass against token-by-token decoding of the same tokens, in the run's dtype, on a few requests): what
exact computation itself differs by. A request fails when

- it was served only through exact and equivalent tags and its max KL exceeds the tolerance — a
  correctness bug, not a trade-off. Exact tags: ``FLOOR_MARGIN × max(floor max KL, KL_RESOLUTION[dtype])``;
  with equivalent tags (``cpu_execute``, ``recompute``): at least ``EQUIVALENT_FLOOR_MARGIN[dtype] ×``
  the floor. In float32 the floor is ~1e-14 nats on CPU, so the resolution sets the tolerance (1e-9); in
  bfloat16 the floor itself is ~1e-4 nats and sets it;
- its statistics break its quality budget, counted above the floor: ``max_mean_kl`` and ``max_p99_kl``
  each allow ``FLOOR_MARGIN ×`` the control's own mean and p99 KL on top, and ``min_top1_agreement``
  does not count a disagreement where the exact top-2 logit gap is within ``TIE_MARGIN ×`` the control's
  largest logit difference (a near-tie that rounding alone flips); ``max_approx_fraction`` and
  ``allowed_tags`` (the approximate tags it may use; exact and equivalent tags are always allowed).

An exact- or equivalent-only request that fails against the exact baseline (:func:`fails_against_baseline`)
is replayed too (``run_audit``); when its replay followed the served routing across 1 to MAX_TIE_SWAPS router
near-ties (``routing_swaps``) within the replay tolerance it is *tie-explained*: it computed what the replay
computes with the routing rounding gave it, so its budget's KL and top-1 and its exact tolerance are checked
against that replay instead of the exact baseline (whose own rounding took the other side of the tie). Such a
replay is only asked when the request fails anyway, so it can turn a FAIL into a PASS, never the reverse.

Runs recorded before the control kept its statistics (only ``runs.numeric_floor_kl``) are judged as
float32 with no allowances. An observe step records the tags it served (a fault's forced ``expert_defer``
among them) and only notes what the controller would have served. A run passes when it finished and all its
requests pass. Failing verdicts name the first diverging position, the step that produced it, the lowest layer
with a non-exact tag on that step and its tags.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from fallbackgate.audit.completeness import check_completeness
from fallbackgate.audit.stats import percentile, top1_outside_ties
from fallbackgate.audit.tolerances import FLOOR_MARGIN, MAX_TIE_SWAPS, TIE_MARGIN, Floor, replay_tolerance, tolerance
from fallbackgate.engine.tags import TAG_EXACTNESS, Exactness, ObjectKind, Tag
from fallbackgate.ledger import audit_queries, quarantine_queries, queries
from fallbackgate.ledger.db import Ledger, LedgerError


@dataclasses.dataclass
class RequestVerdict:
    """The gate's verdict on one request."""

    request_id: str
    passed: bool
    served: Exactness  # the least exact of the tags it was served with
    reasons: list[str] = dataclasses.field(default_factory=list)
    correctness_bug: bool = False
    is_replay_bug: bool = False  # the served logits differ from the replay of the recorded actions
    quality_passed: bool = True  # against the exact baseline: quality budget and allowed tags
    correctness_passed: bool | None = None  # exact tolerance, replay and completeness (None: not audited)
    position: int | None = None  # first diverging output position
    step: int | None = None  # step that produced that position
    layer: int | None = None  # lowest layer with a non-exact tag on that step
    tags: list[str] = dataclasses.field(default_factory=list)  # tags on that step for this request (KV: "kv_block:…")
    stats: dict[str, Any] | None = None
    is_tie_explained: bool = False  # exact/equivalent only, routed across router near-ties: judged vs its replay
    num_tie_swaps: int = 0  # the near-ties its replay followed (when tie-explained)

    @property
    def reason(self) -> str:
        """All reasons in one line ("ok" when it passed; a tie-explained request says so)."""
        plural = "s" if self.num_tie_swaps != 1 else ""
        ties = f" (vs replay: {self.num_tie_swaps} router near-tie{plural})" if self.is_tie_explained else ""
        return ("; ".join(self.reasons) if self.reasons else "ok") + ties


@dataclasses.dataclass
class RunVerdict:
    """The gate's verdict on a run: passes when the run finished and every request passed."""

    run_id: int
    passed: bool
    status: str
    reasons: list[str]
    requests: list[RequestVerdict]
    missing_step_ids: list[int] = dataclasses.field(default_factory=list)  # steps whose ledger rows are incomplete
    missing_pairs: list[tuple[int, str]] = dataclasses.field(default_factory=list)  # (step, request) rows missing
    floor: Floor | None = None  # the exact-vs-exact control the run was judged against


def served_exactness(objects_by_exactness: Mapping[str, int]) -> Exactness:
    """The least exact of the exactness values with objects served (exact when there were no events)."""
    served = (e for e in reversed(Exactness) if objects_by_exactness.get(e.value, 0) > 0)
    return next(served, Exactness.EXACT)


def judge_request(
    request_id: str,
    stats: Mapping[str, Any] | None,
    budget: Mapping[str, Any] | None,
    objects_by_exactness: Mapping[str, int],
    objects_by_tag: Mapping[str, int],
    floor: Floor | float | None,
    replay: Mapping[str, Any] | None = None,
    incomplete: list[str] | None = None,
) -> RequestVerdict:
    """Judge one request from its diff statistics (None when not audited), budget, tag counts, the run's
    floor (a bare number: the control's max KL, float32), its replay statistics (``max_kl``,
    ``max_position``, and ``error`` when the replay could not follow the trace; None when not replayed)
    and what completeness found missing for it.
    ``stats["top1_outside_ties"]``, when present, is the top-1 agreement the budget is checked on.

    Two halves: quality (the budget and allowed tags, against the exact baseline) and correctness (exact
    tolerance for exact- and equivalent-served requests, the replay for every request, completeness)."""
    floor = floor if isinstance(floor, Floor) else Floor(max_kl=floor or 0.0)
    served = served_exactness(objects_by_exactness)
    v = RequestVerdict(request_id, True, served, stats=dict(stats) if stats is not None else None)
    v.is_tie_explained = stats is not None and is_tie_explained(served, replay, floor)
    v.num_tie_swaps = int((replay or {}).get("routing_swaps") or 0) if v.is_tie_explained else 0
    budget = budget or {}
    quality: list[str] = []
    correctness: list[str] = []
    if stats is not None:
        quality += _kl_budget_reasons(_replay_stats(replay, stats) if v.is_tie_explained else stats, budget, floor)
        tol = tolerance(served, floor)
        if not v.is_tie_explained and stats["max_kl"] > tol:
            correctness.append(
                f"correctness bug: served {served.value}-only but max KL {stats['max_kl']:.3g} > {tol:.3g}"
            )
    replay_reasons = _replay_reasons(replay, served, floor)
    v.is_replay_bug = bool(replay_reasons)
    correctness += replay_reasons
    quality += _tag_reasons(budget, objects_by_exactness, objects_by_tag)
    v.correctness_bug = bool(correctness)
    correctness += incomplete or []
    v.reasons = correctness + quality
    v.quality_passed = not quality
    v.correctness_passed = not correctness if (stats is not None or replay is not None or incomplete) else None
    v.passed = not v.reasons
    return v


def _replay_reasons(replay: Mapping[str, Any] | None, served: Exactness, floor: Floor) -> list[str]:
    """Why the served logits fail their replay: it could not follow the recorded actions, or they differ from
    it by more than the served class's replay tolerance (nothing without a replay)."""
    if replay is None or replay.get("max_kl") is None:
        return []
    tol = replay_tolerance(served, floor)
    if replay.get("error"):
        return [f"correctness bug vs replay: it cannot follow the recorded actions: {replay['error']}"]
    if replay["max_kl"] > tol:
        where = f" at output position {replay['max_position']}" if replay.get("max_position") is not None else ""
        return [
            f"correctness bug vs replay: served logits differ from the replay of its recorded actions by "
            f"max KL {replay['max_kl']:.3g}{where} > {tol:.3g}"
        ]
    return []


def _tag_reasons(
    budget: Mapping[str, Any], objects_by_exactness: Mapping[str, int], objects_by_tag: Mapping[str, int]
) -> list[str]:
    reasons = []
    total = sum(objects_by_exactness.values())
    approx = objects_by_exactness.get(Exactness.APPROXIMATE.value, 0)
    limit = budget.get("max_approx_fraction")
    if limit is not None and total and approx / total > limit:
        reasons.append(f"approximate fraction {approx / total:.3g} > {limit:g}")
    allowed = budget.get("allowed_tags")
    if allowed is not None:
        used = sorted(t for t, n in objects_by_tag.items() if n > 0 and _is_approximate(t) and t not in allowed)
        if used:
            reasons.append(f"tags not allowed: {', '.join(used)}")
    return reasons


def fails_against_baseline(
    stats: Mapping[str, Any], budget: Mapping[str, Any] | None, served: Exactness | str, floor: Floor
) -> bool:
    """Whether a request's statistics against the exact baseline break its budget's KL or top-1 (near-ties
    discounted where ``stats`` has ``top1_outside_ties``) or, served exact or equivalent only, its tolerance."""
    if _kl_budget_reasons(stats, budget or {}, floor):
        return True
    return Exactness(served) is not Exactness.APPROXIMATE and stats["max_kl"] > tolerance(served, floor)


def is_tie_explained(served: Exactness | str, replay: Mapping[str, Any] | None, floor: Floor) -> bool:
    """Whether a request served exact or equivalent only was replayed, its replay followed the served routing
    across 1 to MAX_TIE_SWAPS router near-ties and matched the served logits within the replay tolerance."""
    if Exactness(served) is Exactness.APPROXIMATE or not replay or replay.get("error") or replay.get("max_kl") is None:
        return False
    is_few = 0 < (replay.get("routing_swaps") or 0) <= MAX_TIE_SWAPS
    return is_few and replay["max_kl"] <= replay_tolerance(served, floor)


def _replay_stats(replay: Mapping[str, Any], stats: Mapping[str, Any]) -> dict[str, Any]:
    """A replay's statistics in the budget's terms (its p99 where known, else its max); top-1: the better of
    the replay's and the baseline's with near-ties discounted (the replay's own near-ties are not kept)."""
    p99 = replay.get("p99_kl")
    baseline_top1 = stats.get("top1_outside_ties", stats["top1_agreement"])
    return {
        "mean_kl": replay["mean_kl"],
        "p99_kl": replay["max_kl"] if p99 is None else p99,
        "max_kl": replay["max_kl"],
        "top1_agreement": max(replay["top1_agreement"], baseline_top1),
    }


def _is_approximate(tag: str) -> bool:
    try:
        return TAG_EXACTNESS[Tag(tag)] is Exactness.APPROXIMATE
    except ValueError:
        return True  # an unknown tag is never assumed exact


def _kl_budget_reasons(stats: Mapping[str, Any], budget: Mapping[str, Any], floor: Floor) -> list[str]:
    reasons = []
    checks = (
        ("max_mean_kl", "mean_kl", "mean KL", FLOOR_MARGIN * floor.mean_kl),
        ("max_p99_kl", "p99_kl", "p99 KL", FLOOR_MARGIN * floor.p99_kl),
    )
    for key, stat, label, allowance in checks:
        limit = budget.get(key)
        if limit is not None and stats[stat] > limit + allowance:
            extra = f" + floor allowance {allowance:.3g}" if allowance else ""
            reasons.append(f"{label} {stats[stat]:.3g} > budget {limit:g}{extra}")
    limit = budget.get("min_top1_agreement")
    top1 = stats.get("top1_outside_ties", stats["top1_agreement"])
    if limit is not None and top1 < limit:
        ties = " (near-ties not counted)" if "top1_outside_ties" in stats else ""
        reasons.append(f"top-1 agreement {top1:.3g}{ties} < budget {limit:g}")
    return reasons


def _locate(ledger: Ledger, run_id: int, v: RequestVerdict, floor: Floor) -> None:
    """Fill in the first diverging position, its step, layer and tags."""
    diffs = queries.position_diffs(ledger, run_id, v.request_id)
    if not diffs:
        return
    replay_tol, tol = replay_tolerance(v.served, floor), tolerance(v.served, floor)
    beyond_replay = [d for d in diffs if v.is_replay_bug and d["replay_kl"] is not None and d["replay_kl"] > replay_tol]
    beyond_baseline = [d for d in diffs if v.correctness_bug and d["kl"] > tol]  # (inf for approximate: none)
    # served exact or equivalent: the baseline's first divergence (a replay asked to explain it may only fail
    # downstream, where the served routing already followed the corrupted state); approximate: the replay's
    searches = (beyond_baseline, beyond_replay) if v.served is not Exactness.APPROXIMATE else (beyond_replay,)
    first = next((found[0] for found in searches if found), None)
    first = first or next((d for d in diffs if not d["top1_agree"]), None)
    first = first or max(diffs, key=lambda d: d["kl"])
    v.position, v.step = first["position"], first["step_id"]
    if v.step is None:
        return
    events = queries.request_events(ledger, run_id, v.request_id, step_id=v.step)
    kv = ObjectKind.KV_BLOCK.value
    tags = {e["tag"] if e["object_kind"] == ObjectKind.EXPERT.value else f"{kv}:{e['tag']}" for e in events}
    kv_reads = audit_queries.kv_resident_reads(ledger, run_id, v.request_id, v.step)
    v.tags = sorted(tags | ({f"{kv}:{Tag.RESIDENT.value}"} if any(kv_reads) else set()))
    non_exact = [e["layer"] for e in events if e["exactness"] != Exactness.EXACT.value]
    layers = non_exact or [e["layer"] for e in events] + [layer for layer, n in enumerate(kv_reads) if n]
    v.layer = min(layers) if layers else None


def unauditable_verdict(request_id: str, served: Exactness, objects: list[str]) -> RequestVerdict:
    """A request a quarantined object touched (failed, deferred it, or its audit needed it): not judged."""
    reason = f"unauditable (quarantined: {', '.join(objects)})"
    return RequestVerdict(request_id, False, served, [reason], quality_passed=False, correctness_passed=None)


STAT_KEYS = ("num_positions", "mean_kl", "median_kl", "p99_kl", "max_kl", "top1_agreement", "first_divergence")


def request_statistics(
    ledger: Ledger, run_id: int, req: Mapping[str, Any], tie_margin: float
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """One request's audited statistics against the exact baseline (None: not audited) and against its replay
    (None: not replayed), read from its ``request_summaries`` row, its positions read only when needed (top-1
    outside near-ties, the replay's p99 KL)."""
    stats = {k: req[k] for k in STAT_KEYS} if req["num_positions"] is not None else None
    replay = {k: req[f"replay_{k}"] for k in ("max_kl", "mean_kl", "max_position", "top1_agreement", "error")}
    replay["routing_swaps"] = req["replay_routing_swaps"]
    if stats is not None and (tie_margin > 0 or req["replay_max_kl"] is not None):
        diffs = queries.position_diffs(ledger, run_id, req["request_id"])
        if tie_margin > 0:
            stats["top1_outside_ties"] = top1_outside_ties(diffs, tie_margin)
        replay_kls = sorted(d["replay_kl"] for d in diffs if d["replay_kl"] is not None)
        replay["p99_kl"] = percentile(replay_kls, 0.99) if replay_kls else None
    return stats, replay if req["replay_max_kl"] is not None else None


def evaluate_run(ledger: Ledger, run_id: int) -> RunVerdict:
    """Judge every request of ``run_id`` and the run; raise LedgerError when the run does not exist."""
    run = queries.get_run(ledger, run_id)
    if run is None:
        raise LedgerError(f"no run {run_id} in ledger {ledger.display_url}")
    floor = Floor.of_run(run)
    tie_margin = TIE_MARGIN * floor.max_abs_dlogit
    by_exactness = queries.request_exactness(ledger, run_id)
    by_tag = queries.request_tags(ledger, run_id)
    verdicts = []
    requests = queries.request_summaries(ledger, run_id)
    completeness = check_completeness(ledger, run, requests)
    touched, quarantined = quarantine_queries.unauditable(ledger, run_id)
    for req in requests:
        rid = req["request_id"]
        stats, replay = request_statistics(ledger, run_id, req, tie_margin)
        v = judge_request(rid, stats, req["budget"], by_exactness.get(rid, {}), by_tag.get(rid, {}), floor,
                          replay=replay, incomplete=completeness.request_reasons.get(rid))  # fmt: skip
        if rid in touched:  # its output or its audit needs bytes that cannot be read: never a PASS
            v = unauditable_verdict(rid, v.served, touched[rid])
        elif not v.passed:
            _locate(ledger, run_id, v, floor)
        verdicts.append(v)
    reasons = [f"run is {run['status']}"] if run["status"] != "complete" else []
    reasons += [f"unauditable (quarantined: {', '.join(quarantined)})"] if quarantined else []
    reasons += completeness.reasons
    failed = [v.request_id for v in verdicts if not v.passed]
    if failed:
        reasons.append(f"{len(failed)} of {len(verdicts)} requests failed: {', '.join(failed[:10])}")
    return RunVerdict(
        run_id,
        not reasons,
        run["status"],
        reasons,
        verdicts,
        completeness.missing_step_ids,
        completeness.missing_pairs,
        floor,
    )

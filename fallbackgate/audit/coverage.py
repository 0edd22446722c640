"""Completeness from the engine's side: every (step, request) the engine scheduled has its row.

Without replaying anything (exact-only requests are never replayed):

- per step, the step_requests rows equal the requests the step row says it scheduled;
- per request, its rows' positions tile [0, prompt + output - 1) (the last output token is sampled, never fed)
  with no gap, and overlap only where a preemption made it re-prefill; the first ``num_reused_tokens``
  positions count as computed when the request adopted their KV from kept prefix blocks;
- its sampling rows sampled output token k at position prompt - 1 + k, once each, for every output token;
- events, position diffs and step rows name only (step, request) pairs that have a row, and requests that
  have a request row.

A gap is paired with the steps between its neighbours that lack a row: the missing (step, request) pairs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from fallbackgate.ledger import audit_queries
from fallbackgate.ledger.db import Ledger

MAX_LISTED = 10  # pairs named in one reason


@dataclasses.dataclass
class Coverage:
    """What the engine-side counts found missing."""

    reasons: list[str] = dataclasses.field(default_factory=list)  # run-level
    request_reasons: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    missing_pairs: list[tuple[int, str]] = dataclasses.field(default_factory=list)  # (step, request) without a row
    short_step_ids: list[int] = dataclasses.field(default_factory=list)  # steps with fewer rows than requests


def pair_text(pairs: list[tuple[int, str]]) -> str:
    """ "(step 4, request a), …" with at most MAX_LISTED named."""
    more = f" and {len(pairs) - MAX_LISTED} more" if len(pairs) > MAX_LISTED else ""
    return ", ".join(f"(step {s}, request {r})" for s, r in pairs[:MAX_LISTED]) + more


def check_coverage(ledger: Ledger, run_id: int, requests: list[Mapping[str, Any]]) -> Coverage:
    """Reconcile step_requests rows with the steps and requests (see the module docstring)."""
    out = Coverage()
    counts = audit_queries.step_row_counts(ledger, run_id)
    short = {c["step_id"]: c["expected"] - c["found"] for c in counts if c["found"] < c["expected"]}
    extra = [c["step_id"] for c in counts if c["found"] > c["expected"]]
    out.short_step_ids = sorted(short) + extra
    if short:
        out.reasons.append(
            f"ledger incomplete: steps {', '.join(map(str, sorted(short)[:MAX_LISTED]))} have fewer step_requests "
            f"rows than the requests they scheduled ({sum(short.values())} missing)"
        )
    if extra:
        out.reasons.append(
            f"ledger inconsistent: steps {extra[:MAX_LISTED]} have more step_requests rows than requests"
        )
    pairs = set(audit_queries.pairs_without_step_request(ledger, run_id))
    rows: dict[str, list[dict[str, Any]]] = {}
    for r in audit_queries.step_request_positions(ledger, run_id):
        rows.setdefault(r["request_id"], []).append(r)
    for req in requests:
        if not req.get("tag_counts"):  # a synthetic request: no positions to tile
            continue
        rid = req["request_id"]
        reasons, gaps = _tile(req, rows.get(rid, []))
        for after, before in gaps:
            pairs |= {(s, rid) for s in short if after < s < before}
        if reasons:
            out.request_reasons.setdefault(rid, []).extend(reasons)
    for step, rid in sorted(pairs):
        out.request_reasons.setdefault(rid, []).append(
            f"ledger incomplete: no step_requests row for step {step}, which scheduled the request"
        )
    out.missing_pairs = sorted(pairs)
    if pairs:
        out.reasons.append(f"ledger incomplete: missing (step, request) rows {pair_text(out.missing_pairs)}")
    orphans = audit_queries.requests_without_row(ledger, run_id)
    if orphans:
        out.reasons.append(
            f"ledger inconsistent: events or step rows name requests with no request row: {', '.join(orphans[:10])}"
        )
    return out


def _tile(req: Mapping[str, Any], rows: list[dict[str, Any]]) -> tuple[list[str], list[tuple[int, float]]]:
    """Reasons the request's rows do not tile its positions, and each gap as (step before, step after)."""
    num_prompt, num_output = int(req["num_prompt_tokens"]), int(req["num_output_tokens"])
    end = num_prompt + num_output - 1 if num_output else num_prompt
    reasons: list[str] = []
    gaps: list[tuple[int, float]] = []
    length, previous, restarts, sampled = int(req.get("num_reused_tokens") or 0), 0, 0, []
    for r in rows:
        start, n, step = int(r["start_position"]), int(r["num_tokens"]), int(r["step_id"])
        if start > length:
            reasons.append(f"positions {length}..{start - 1} computed by no recorded step (before step {step})")
            gaps.append((previous, step))
        elif start < length:
            restarts += 1
            if restarts > int(req.get("num_preemptions") or 0):
                reasons.append(f"step {step} recomputes positions {start}..{length - 1} without a preemption")
        if r["is_sampled"]:
            sampled.append(start + n - 1)
        length, previous = start + n, step
    if length < end:
        reasons.append(f"positions {length}..{end - 1} computed by no recorded step (after step {previous})")
        gaps.append((previous, float("inf")))
    elif length > end:
        reasons.append(f"steps computed {length} positions for {end} fed tokens")
    expected = list(range(num_prompt - 1, num_prompt - 1 + num_output))
    if sorted(sampled) != expected:
        missing = sorted(set(expected) - set(sampled))
        unexpected = sorted(set(sampled) - set(expected)) + _repeated(sampled)
        reasons.append(
            f"{len(sampled)} sampling rows for {num_output} output tokens"
            + (f"; no row sampled at positions {missing[:MAX_LISTED]}" if missing else "")
            + (f"; rows sampled at positions {unexpected[:MAX_LISTED]}" if unexpected else "")
        )
    return [f"ledger incomplete: {r}" for r in reasons], gaps


def _repeated(positions: list[int]) -> list[int]:
    seen: set[int] = set()
    return sorted({p for p in positions if p in seen or seen.add(p)})  # type: ignore[func-returns-value]

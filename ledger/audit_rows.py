"""Ledger rows of audit results: per-position diffs and request statistics, and verdicts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fallbackgate.ledger.models import PositionDiffRow, RequestStatRow, utcnow
from fallbackgate.ledger.rows import Rows, SampleSteps, plain

DIFF_FIELDS: tuple[str, ...] = (
    "position",
    "token_id",
    "kl",
    "top1_agree",
    "delta_p",
    "max_abs_dlogit",
    "vllm_top5_ok",
    "logp_exact",
    "logp_engine",
    "exact_top2_gap",
    "replay_kl",
)
STAT_FIELDS: tuple[str, ...] = tuple(
    c.name
    for c in RequestStatRow.__table__.columns
    if c.name not in ("run_id", "request_id") and not c.name.startswith("replay_")
)


def verdict_row(
    run_id: int,
    request_id: str | None,
    passed: bool,
    reason: str,
    *,
    position: int | None = None,
    step: int | None = None,
    layer: int | None = None,
    tags: Sequence[str] | None = None,
    quality_passed: bool | None = None,
    correctness_passed: bool | None = None,
) -> dict[str, Any]:
    """A verdicts-table row: a request's verdict (or the run's when ``request_id`` is None)."""
    return {
        "run_id": run_id,
        "request_id": request_id,
        "passed": bool(passed),
        "reason": reason,
        "first_divergence_position": position,
        "first_divergence_step": step,
        "first_divergence_layer": layer,
        "first_divergence_tags": list(tags) if tags is not None else None,
        "quality_passed": quality_passed,
        "correctness_passed": correctness_passed,
        "created_at": utcnow(),
    }


def diff_rows(
    run_id: int,
    request_id: str,
    diffs: list[Any],
    stats: Any | None,
    step_ids: Sequence[int | None] | None,
    rows: Rows,
    sample_steps: SampleSteps,
) -> int:
    """Append position-diff rows (and the request's stats row) to ``rows``; return rows added.

    A position's step is ``step_ids[position]`` when given, else the position-th step recorded as
    sampling a token for the request (None when unknown).
    """
    tracked = sample_steps.pop((run_id, request_id), [])
    out = rows.setdefault(PositionDiffRow.__table__, [])
    for d in diffs:
        row = {f: plain(getattr(d, f, None)) for f in DIFF_FIELDS}
        pos = row["position"]
        if step_ids is not None:
            row["step_id"] = step_ids[pos]
        else:
            row["step_id"] = tracked[pos] if pos < len(tracked) else None
        row["run_id"], row["request_id"] = run_id, request_id
        out.append(row)
    if stats is not None:
        row = {f: plain(getattr(stats, f)) for f in STAT_FIELDS}
        row["run_id"], row["request_id"] = run_id, request_id
        rows.setdefault(RequestStatRow.__table__, []).append(row)
    return len(diffs) + 1

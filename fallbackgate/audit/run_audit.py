"""Auditing a run's sampled requests: the floor first, then each request against its baselines.

1. The exact-vs-exact control runs on the first few audited requests (their first FLOOR_POSITIONS output
   positions): the run's numeric floor.
2. Each audited request is compared with the exact baseline. Requests with an approximate tag are also
   replayed (their recorded actions repeated from the ledger); for exact- and equivalent-only requests the
   replay would be the exact baseline again, so their correctness is judged against it directly.
3. An exact- or equivalent-only request whose KL exceeds the tolerance of the floor so far gets its own
   control over every position, folded into the floor: the floor grows only with measured exact-vs-exact
   differences (bf16 rounding is heavy-tailed across prompts), never with what was served. A real bug
   leaves its request's own control small and still fails.
4. An exact- or equivalent-only request still beyond what the floor allows an exact computation
   (:func:`is_beyond_floor`) is replayed too: where the served forward routed a token across a router near-tie
   the other way (in bf16 one rounding step apart), the replay routes it as served (``routing_ties``) and
   computes what was served, and the gate judges the request against that replay.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from fallbackgate.audit.auditor import (
    NUM_FLOOR_REQUESTS,
    FloorControl,
    ServedRows,
    audit_request,
    control_diffs,
    in_memory,
    replay_diffs,
)
from fallbackgate.audit.baseline import Baseline
from fallbackgate.audit.gate import FLOOR_MARGIN, KL_RESOLUTION, Floor, served_exactness, tolerance
from fallbackgate.audit.stats import PositionDiff, RequestDiffStats
from fallbackgate.engine.baseline.api import BaselineEngine
from fallbackgate.engine.experts.quarantine import ExpertQuarantined
from fallbackgate.engine.messages import RequestOutput
from fallbackgate.engine.tags import TAG_EXACTNESS, Exactness, Tag
from fallbackgate.ledger.db import Ledger

FLOOR_POSITIONS = 16  # output positions of each up-front control request


@dataclasses.dataclass(slots=True)
class AuditedRequest:
    """One audited request's diffs and summaries."""

    request_id: str
    diffs: list[PositionDiff]  # per position, against the exact baseline (with replay KL when replayed)
    stats: RequestDiffStats  # summary against the exact baseline
    replay: dict[str, Any] | None  # summary against the replay (None: exact or equivalent only)


def objects_by_exactness(output: RequestOutput) -> dict[str, int]:
    """Objects the engine served the request with, per exactness."""
    out: dict[str, int] = {}
    for tag, count in output.tag_counts.items():
        exactness = TAG_EXACTNESS[Tag(tag)].value
        out[exactness] = out.get(exactness, 0) + count
    return out


def initial_floor(
    engine: BaselineEngine, requests: list[tuple[str, list[int], list[int]]], baseline: Baseline | None = None
) -> FloorControl:
    """The control on the first NUM_FLOOR_REQUESTS (request id, prompt ids, output ids), FLOOR_POSITIONS
    output positions each, against `baseline` (the batched baseline of `requests`; default: one of its own)."""
    chosen = requests[:NUM_FLOOR_REQUESTS]
    baseline = baseline or Baseline(engine, [(p, o) for _, p, o in chosen])
    control = FloorControl(engine.dtype_name)
    for index, (request_id, prompt_ids, output_ids) in enumerate(chosen):
        diffs, stats = control_diffs(engine, prompt_ids, output_ids, baseline.of(index), FLOOR_POSITIONS)
        control.add(request_id, diffs, stats)
    return control


def widen_floor(
    engine: BaselineEngine,
    control: FloorControl,
    request: tuple[str, list[int], list[int]],
    served: Exactness,
    max_kl: float,
    baseline: ServedRows | None = None,
) -> None:
    """Fold the request's own full control (against its `baseline` rows) into the floor when it was served
    exact or equivalent only and its KL against the exact baseline exceeds the tolerance of the floor so far."""
    floor = Floor.of_run({"numeric_floor": control.summary()})
    if served is not Exactness.APPROXIMATE and max_kl > tolerance(served, floor):
        request_id, prompt_ids, output_ids = request
        control.add(request_id, *control_diffs(engine, prompt_ids, output_ids, baseline))


def is_beyond_floor(stats: Mapping[str, Any], served: Exactness, floor: Floor) -> bool:
    """Whether a request served exact or equivalent only differs from the exact baseline by more than the
    control allows an exact computation: its mean or p99 KL above FLOOR_MARGIN × the control's (at least the
    dtype's KL resolution), or its max KL above the tolerance (`stats`: ``mean_kl``, ``p99_kl``, ``max_kl``)."""
    if served is Exactness.APPROXIMATE:
        return False
    resolution = KL_RESOLUTION.get(floor.dtype, KL_RESOLUTION["float32"])
    return (
        stats["mean_kl"] > FLOOR_MARGIN * max(floor.mean_kl, resolution)
        or stats["p99_kl"] > FLOOR_MARGIN * max(floor.p99_kl, resolution)
        or stats["max_kl"] > tolerance(served, floor)
    )


def replay_beyond_floor(
    engine: BaselineEngine,
    ledger: Ledger,
    run_id: int,
    request_id: str,
    served_rows: ServedRows,
    served: Exactness,
    stats: Mapping[str, Any],
    control: FloorControl,
) -> tuple[list[float] | None, dict[str, Any] | None]:
    """The replay of an exact- or equivalent-only request beyond the floor so far (:func:`is_beyond_floor`):
    KL(replay ‖ served) per position and its summary (:func:`~fallbackgate.audit.auditor.replay_diffs`);
    (None, None) when it is within the floor or approximate (an approximate request is always replayed)."""
    floor = Floor.of_run({"numeric_floor": control.summary()})
    if not is_beyond_floor(stats, served, floor):
        return None, None
    return replay_diffs(engine, ledger, run_id, request_id, served_rows)


def auditable(engine: BaselineEngine, outputs: list[RequestOutput]) -> tuple[list[RequestOutput], dict[str, str]]:
    """The outputs whose exact baseline can be computed, and the rest: request id -> the quarantined object
    its baseline needs (the checkpoint's bytes of it cannot be read correctly). Tried together first."""
    try:
        Baseline(engine, [(o.prompt_token_ids, o.output_token_ids) for o in outputs])
        return outputs, {}
    except ExpertQuarantined:
        pass
    kept, unaudited = [], {}
    for output in outputs:
        try:
            Baseline(engine, [(output.prompt_token_ids, output.output_token_ids)])
            kept.append(output)
        except ExpertQuarantined as exc:
            unaudited[output.request_id] = str(exc)
    return kept, unaudited


def audit_outputs(
    engine: BaselineEngine, ledger: Ledger, run_id: int, audited: list[RequestOutput]
) -> tuple[list[AuditedRequest], dict[str, Any], dict[str, str]]:
    """Audit `audited` (their steps and requests already in `ledger`); returns each request's diffs, the
    run's floor statistics (see the module docstring) and the requests left unaudited because their
    baseline needs a quarantined object (request id -> the quarantine)."""
    audited, unaudited = auditable(engine, audited)
    if not audited:
        return [], FloorControl(engine.dtype_name).summary(), unaudited
    requests = [(o.request_id, o.prompt_token_ids, o.output_token_ids) for o in audited]
    baseline = Baseline(engine, [(p, o) for _, p, o in requests])
    control = initial_floor(engine, requests, baseline)
    results = []
    for index, (output, request) in enumerate(zip(audited, requests, strict=True)):
        served = served_exactness(objects_by_exactness(output))
        rows = baseline.of(index)
        ids = (output.prompt_token_ids, output.output_token_ids)
        try:
            diffs, stats, replay = audit_request(
                engine, ledger, run_id, output.request_id, *ids, in_memory(output), served is Exactness.APPROXIMATE,
                rows,
            )  # fmt: skip
            widen_floor(engine, control, request, served, stats.max_kl, rows)
            if replay is None:
                kls, replay = replay_beyond_floor(
                    engine, ledger, run_id, output.request_id, in_memory(output), served, dataclasses.asdict(stats),
                    control,
                )  # fmt: skip
                diffs = [dataclasses.replace(d, replay_kl=k) for d, k in zip(diffs, kls, strict=True)] if kls else diffs
        except ExpertQuarantined as exc:  # its replay needs a quarantined object
            unaudited[output.request_id] = str(exc)
            continue
        results.append(AuditedRequest(output.request_id, diffs, stats, replay))
    return results, control.summary(), unaudited

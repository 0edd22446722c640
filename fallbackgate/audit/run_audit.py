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
4. An exact- or equivalent-only request that fails against the exact baseline under the final floor
   (:func:`needs_replay`) is replayed too: where the served forward routed a token across a router near-tie the
   other way (in bf16 one rounding step apart), the replay routes it as served (``routing_ties``) and computes
   what was served, and the gate judges the request against that replay (``gate.is_tie_explained``).
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
from fallbackgate.audit.gate import fails_against_baseline, served_exactness
from fallbackgate.audit.stats import PositionDiff, RequestDiffStats, top1_outside_ties
from fallbackgate.audit.tolerances import TIE_MARGIN, Floor, tolerance
from fallbackgate.engine.baseline.api import BaselineEngine
from fallbackgate.engine.experts.quarantine import ExpertQuarantined
from fallbackgate.engine.messages import RequestOutput
from fallbackgate.engine.tags import TAG_EXACTNESS, Exactness, Tag
from fallbackgate.ledger import queries
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


def needs_replay(
    stats: Mapping[str, Any], diffs: list[Any], budget: Mapping[str, Any] | None, served: Exactness, floor: Floor
) -> bool:
    """Whether a request served exact or equivalent only fails against the exact baseline as the gate judges
    it (``gate.fails_against_baseline``, near-tie top-1 flips discounted from `diffs`: PositionDiff objects or
    ledger rows), so that its replay may explain it (an approximate request is always replayed)."""
    if served is Exactness.APPROXIMATE or not diffs:
        return False
    judged = dict(stats)
    tie_margin = TIE_MARGIN * floor.max_abs_dlogit
    if tie_margin > 0:
        judged["top1_outside_ties"] = top1_outside_ties(diffs, tie_margin)
    return fails_against_baseline(judged, budget, served, floor)


def replay_to_explain(
    engine: BaselineEngine,
    ledger: Ledger,
    run_id: int,
    request_id: str,
    served_rows: ServedRows,
    diffs: list[Any],
    budget: Mapping[str, Any] | None,
    served: Exactness,
    stats: Mapping[str, Any],
    floor: Floor,
) -> tuple[list[float] | None, dict[str, Any] | None]:
    """The replay of an exact- or equivalent-only request that fails against the exact baseline under the
    run's final `floor` (:func:`needs_replay`): KL(replay ‖ served) per position and its summary
    (:func:`~fallbackgate.audit.auditor.replay_diffs`); (None, None) when not needed, or when the replay needs
    a quarantined object (the request is then judged against the baseline alone)."""
    if not needs_replay(stats, diffs, budget, served, floor):
        return None, None
    try:
        return replay_diffs(engine, ledger, run_id, request_id, served_rows)
    except ExpertQuarantined:
        return None, None


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
    results, served_of = [], {}
    for index, (output, request) in enumerate(zip(audited, requests, strict=True)):
        served = served_exactness(objects_by_exactness(output))
        rows = baseline.of(index)
        ids = (output.prompt_token_ids, output.output_token_ids)
        try:
            diffs, stats, replay = audit_request(
                engine, ledger, run_id, output.request_id, *ids, in_memory(output), served is Exactness.APPROXIMATE,
                rows,
            )  # fmt: skip
        except ExpertQuarantined as exc:  # its replay needs a quarantined object
            unaudited[output.request_id] = str(exc)
            continue
        widen_floor(engine, control, request, served, stats.max_kl, rows)
        results.append(AuditedRequest(output.request_id, diffs, stats, replay))
        served_of[output.request_id] = (served, output)
    _explain(engine, ledger, run_id, results, served_of, Floor.of_run({"numeric_floor": control.summary()}))
    return results, control.summary(), unaudited


def _explain(
    engine: BaselineEngine,
    ledger: Ledger,
    run_id: int,
    results: list[AuditedRequest],
    served_of: dict[str, tuple[Exactness, RequestOutput]],
    floor: Floor,
) -> None:
    """Replay, under the final floor, the exact- or equivalent-only results that fail against the baseline."""
    budgets = {r["request_id"]: r["budget"] for r in queries.request_summaries(ledger, run_id)}
    for index, result in enumerate(results):
        served, output = served_of[result.request_id]
        if result.replay is not None:
            continue
        stats = dataclasses.asdict(result.stats)
        kls, replay = replay_to_explain(
            engine, ledger, run_id, result.request_id, in_memory(output), result.diffs,
            budgets.get(result.request_id), served, stats, floor,
        )  # fmt: skip
        if replay is not None:
            diffs = result.diffs
            if kls:
                diffs = [dataclasses.replace(d, replay_kl=k) for d, k in zip(diffs, kls, strict=True)]
            results[index] = dataclasses.replace(result, diffs=diffs, replay=replay)

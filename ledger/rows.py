"""Turning the engine's messages into ledger rows (plain dicts for bulk inserts)."""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Table

from fallbackgate.engine.experts.read_ahead import TransferClock
from fallbackgate.engine.messages import RequestOutput, StepPlan, StepResult
from fallbackgate.engine.tags import Exactness
from fallbackgate.ledger.models import EventObjectsRow, EventRow, KVCopyRow, Step, StepRequest, VerificationRow
from fallbackgate.ledger.vocabulary import EXACTNESS

Rows = dict[Table, list[Any]]
"""Pending rows per table: dicts, or tuples (for the tables in ``row_columns.TUPLE_COLUMNS``, in its order)."""
SampleSteps = dict[tuple[int, str], list[int]]
"""(run id, request id) -> ids of the steps that sampled a token for the request, in order."""


def value(x: Any) -> Any:
    """An enum's value, anything else unchanged."""
    return x.value if isinstance(x, enum.Enum) else x


def plain(x: Any) -> Any:
    """Python scalars for numpy/torch scalars (drivers want plain floats, ints and bools)."""
    return x.item() if hasattr(x, "item") else x


def _transfer_values(clock: TransferClock) -> tuple[Any, ...]:
    """The step's measured expert disk reads, in the order STEP_COLUMNS ends with."""
    return (
        clock.transfer_s,
        clock.exposed_s,
        clock.num_predicted,
        clock.num_predicted_used,
        clock.num_unpredicted,
    )


def step_rows(
    run_id: int,
    plan: StepPlan,
    result: StepResult,
    rows: Rows,
    sample_steps: SampleSteps,
) -> int:
    """Append the step row and its event rows to ``rows``; return the number of rows added."""
    clock = result.transfer
    rows.setdefault(Step.__table__, []).append(
        (
            run_id,
            plan.step_id,
            getattr(plan.kind, "_value_", plan.kind),
            len(plan.request_ids),
            sum(plan.num_tokens.values()),
            plan.is_observe,
            result.wall_s,
            result.modeled_s,
            result.num_device_bytes_expert,
            result.num_device_bytes_kv,
            len(result.events),
            len(result.verifications),
            *(_transfer_values(clock) if clock is not None else (None,) * 5),
            _total(result.expert_resident_uses),
            _total(result.kv_resident_reads),
        )
    )
    for rid in result.sampled_token_ids:
        sample_steps.setdefault((run_id, rid), []).append(plan.step_id)
    rows.setdefault(StepRequest.__table__, []).extend(_step_request_rows(run_id, plan, result))
    rows.setdefault(KVCopyRow.__table__, []).extend(kv_copy_rows(run_id, plan.step_id, result))
    failed = [v for v in result.verifications if not v.passed]  # passing checks are counted on the step row
    if failed:
        rows.setdefault(VerificationRow.__table__, []).extend(verification_rows(run_id, failed))
    _append_event_rows(run_id, result, rows)
    return 1 + len(plan.request_ids) + len(result.events) + len(result.kv_copies)


def _append_event_rows(run_id: int, result: StepResult, rows: Rows) -> None:
    """The step's events as ``events`` rows, and those naming their objects as ``event_objects`` rows."""
    events = rows.setdefault(EventRow.__table__, [])
    objects = rows.setdefault(EventObjectsRow.__table__, [])
    exactness, unknown = EXACTNESS.get, Exactness.APPROXIMATE.value  # an unknown tag is never assumed exact
    for e in result.events:  # tuples in EVENT_COLUMNS order; getattr(_value_) is the cheap enum -> str
        tag = getattr(e.tag, "_value_", e.tag)
        events.append(
            (
                run_id,
                e.step_id,
                e.request_id,
                e.layer,
                getattr(e.object_kind, "_value_", e.object_kind),
                tag,
                exactness(tag, unknown),
                e.count,
                e.bytes_moved,
                getattr(e.source_tier, "_value_", e.source_tier),
                e.predicted_cost,
                e.modeled_s,
                e.note,
            )
        )
        if e.object_ids:
            objects.append(
                (
                    run_id,
                    e.step_id,
                    e.request_id,
                    e.layer,
                    getattr(e.object_kind, "_value_", e.object_kind),
                    tag,
                    e.bits,
                    e.is_rebuild,
                    ",".join(map(str, e.object_ids)),
                )
            )


def kv_copy_rows(run_id: int, step_id: int, result: StepResult) -> list[dict[str, Any]]:
    """One ``kv_copies`` row per copy change the step's result carries (the KV store's journal)."""
    return [
        {
            "run_id": run_id,
            "step_id": step_id,
            "seq": c.seq,
            "request_id": c.request_id,
            "layer": c.layer,
            "action": value(c.action),
            "tier": value(c.tier),
            "bits": c.bits,
            "block_ids": ",".join(map(str, c.block_ids)),
            "num_bytes": c.num_bytes,
            "code_checksums": ",".join(f"{x:016x}" for x in c.checksums) if c.checksums else None,
        }
        for c in result.kv_copies
    ]


def verification_rows(run_id: int, verifications: Sequence[Any]) -> list[dict[str, Any]]:
    """Rows of weight copies checked against the checkpoint (engine ``Verification`` objects)."""
    return [
        {
            "run_id": run_id,
            "step_id": v.step_id,
            "object_kind": v.object_kind,
            "name": v.name,
            "tier": value(v.tier),
            "passed": v.passed,
            "note": v.note,
        }
        for v in verifications
    ]


def _step_request_rows(run_id: int, plan: StepPlan, result: StepResult) -> list[tuple[Any, ...]]:
    """Per request of the step, in STEP_REQUEST_COLUMNS order: the positions it computed, whether it
    sampled, its event and object counts, its resident KV reads, its rebuild pass's objects and its resident
    expert uses (in total and per layer)."""
    num_events: dict[str, int] = {}
    num_objects: dict[str, int] = {}
    rebuilt: dict[str, int] = {}  # objects computed in the request's KV rebuild pass (a recompute's evidence)
    for e in result.events:
        num_events[e.request_id] = num_events.get(e.request_id, 0) + 1
        num_objects[e.request_id] = num_objects.get(e.request_id, 0) + e.count
        if e.is_rebuild:
            rebuilt[e.request_id] = rebuilt.get(e.request_id, 0) + e.count
    sampled, kv_reads, uses = result.sampled_token_ids, result.kv_resident_reads, result.expert_resident_uses
    digests = result.routing_digests
    return [
        (
            run_id,
            plan.step_id,
            rid,
            plan.start_positions[rid],
            plan.num_tokens[rid],
            rid in sampled,
            num_events.get(rid, 0),
            num_objects.get(rid, 0),
            _per_layer(kv_reads.get(rid)),
            rebuilt.get(rid, 0),
            sum(uses[rid].values()) if rid in uses else 0,
            _per_layer(uses.get(rid)),
            digests_text(digests.get(rid)),
        )
        for rid in plan.request_ids
    ]


def _total(counts: dict[str, dict[int, int]]) -> int:
    """The sum of request -> layer -> count."""
    return sum([sum(by_layer.values()) for by_layer in counts.values()])


def per_layer_counts(text: str | None) -> dict[int, int]:
    """layer -> count from a per-layer column ("3,3,0,2"; layers with 0 left out)."""
    if not text:
        return {}
    return {layer: int(n) for layer, n in enumerate(text.split(",")) if int(n)}


def digests_text(digests: dict[int, int] | None) -> str | None:
    """ "0a1b...,,ff00...": a 64-bit digest per layer from 0 in hex, empty for layers without one (None when
    there are none)."""
    if not digests:
        return None
    return ",".join(f"{digests[layer]:016x}" if layer in digests else "" for layer in range(max(digests) + 1))


def per_layer_digests(text: str | None) -> dict[int, int]:
    """layer -> digest from a :func:`digests_text` column."""
    if not text:
        return {}
    return {layer: int(x, 16) for layer, x in enumerate(text.split(",")) if x}


def _per_layer(counts: dict[int, int] | None) -> str | None:
    """ "3,3,0,2": a count per layer from 0 (None when there are none)."""
    if not counts:
        return None
    layers = tuple(counts)
    if layers == _consecutive(layers[0], len(layers)):  # the engine's usual order: a decode step's hot path
        return "0," * layers[0] + _joined(tuple(counts.values()))
    return ",".join(str(counts.get(layer, 0)) for layer in range(max(counts) + 1))


@functools.lru_cache(maxsize=256)
def _consecutive(first: int, num: int) -> tuple[int, ...]:
    return tuple(range(first, first + num))


@functools.lru_cache(maxsize=4096)
def _joined(values: tuple[int, ...]) -> str:
    """The counts of a step's requests repeat (a decode token uses top_k experts of every layer): built once."""
    return ",".join(map(str, values))


def request_row(
    run_id: int,
    out: RequestOutput,
    slo: Mapping[str, Any] | None,
    budget: Mapping[str, Any] | None,
    prompt: str | None,
    status: str = "finished",
) -> dict[str, Any]:
    """The requests-table row of a request that ended with ``status`` ("finished" or "cancelled")."""
    return {
        "run_id": run_id,
        "request_id": out.request_id,
        "request_class": out.request_class,
        "prompt": prompt,
        "num_prompt_tokens": len(out.prompt_token_ids),
        "num_output_tokens": len(out.output_token_ids),
        "num_preemptions": out.num_preemptions,
        "num_reused_tokens": out.num_reused_tokens,
        "slo": dict(slo) if slo is not None else None,
        "budget": dict(budget) if budget is not None else None,
        "ttft_s": out.ttft_s if out.output_token_ids else None,  # a request cancelled before its first token
        "tpot_s": out.tpot_s,
        "modeled_ttft_s": out.modeled_ttft_s,
        "modeled_tpot_s": out.modeled_tpot_s,
        "verdict": None,
        "tag_counts": {str(value(k)): int(v) for k, v in out.tag_counts.items()},
        "token_ids": [int(t) for t in (*out.prompt_token_ids, *out.output_token_ids)],
        "status": status,
    }

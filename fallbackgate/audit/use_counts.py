"""Counted uses: the resident work the step rows carry as counts instead of event rows must add up.

Checked against what the engine counted itself and against the model's routing:

- per step: the step row's resident expert uses and device KV reads equal the sums over its step_requests
  rows;
- per step × request: the per-layer resident uses sum to the row's total;
- per step × request × MoE layer (when the run recorded its routing): the experts used there, counted and
  event rows together, are at least ``top_k`` and at most ``min(tokens × top_k, experts of the layer)`` — a
  decode token uses exactly ``top_k`` — and a layer without routed experts uses none. A request whose KV
  rebuild pass ran in the step is checked for the lower bound only (the pass computed more positions).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fallbackgate.ledger import audit_queries
from fallbackgate.ledger.db import Ledger
from fallbackgate.ledger.rows import per_layer_counts


def check_use_counts(
    ledger: Ledger, run_id: int, memory: Mapping[str, Any] | None
) -> tuple[list[str], dict[str, list[str]]]:
    """(run-level reasons, request id -> reasons) for counts that do not add up (see the module docstring)."""
    rows = audit_queries.step_request_uses(ledger, run_id)
    by_step: dict[int, list[int]] = {}
    request_reasons: dict[str, list[str]] = {}
    for r in rows:
        expert = per_layer_counts(r["resident_expert_uses"])
        total = r["num_resident_expert_uses"]
        sums = by_step.setdefault(r["step_id"], [0, 0])
        sums[0] += int(total or 0)
        sums[1] += sum(per_layer_counts(r["kv_resident_reads"]).values())
        if total is not None and sum(expert.values()) != total:
            request_reasons.setdefault(r["request_id"], []).append(
                f"ledger incomplete at step {r['step_id']}: resident expert uses per layer sum to "
                f"{sum(expert.values())}, the row counts {total}"
            )
    reasons = []
    for s in audit_queries.step_resident_totals(ledger, run_id):
        found = by_step.get(s["step_id"], [0, 0])
        for name, expected, got in (
            ("resident expert uses", s["num_resident_expert_uses"], found[0]),
            ("device KV reads", s["num_resident_kv_reads"], found[1]),
        ):
            if expected is not None and expected != got:
                reasons.append(
                    f"ledger incomplete: step {s['step_id']} counted {expected} {name}, its request rows {got}"
                )
    routing = (memory or {}).get("routing")
    if routing:
        for rid, reason in _routing_reasons(ledger, run_id, rows, routing):
            request_reasons.setdefault(rid, []).append(reason)
    return reasons, request_reasons


def _routing_reasons(
    ledger: Ledger, run_id: int, rows: list[dict[str, Any]], routing: Mapping[str, Any]
) -> list[tuple[str, str]]:
    """(request id, reason) for every step × request × layer whose expert uses the routing cannot produce."""
    top_k = int(routing["top_k"])
    experts_per_layer = {int(k): int(n) for k, n in routing["experts_per_layer"].items()}
    uses: dict[tuple[int, str], dict[int, int]] = {}
    for r in rows:
        uses[(r["step_id"], r["request_id"])] = per_layer_counts(r["resident_expert_uses"])
    for e in audit_queries.expert_event_objects(ledger, run_id):
        by_layer = uses.get((e["step_id"], e["request_id"]))
        if by_layer is not None:  # engine prefetches belong to no request row
            by_layer[e["layer"]] = by_layer.get(e["layer"], 0) + int(e["objects"])
    out = []
    for r in rows:
        by_layer = uses[(r["step_id"], r["request_id"])]
        is_rebuilt = bool(r["rebuild_objects"])
        for layer in sorted(set(by_layer) | set(experts_per_layer)):
            found, num_experts = by_layer.get(layer, 0), experts_per_layer.get(layer, 0)
            most = min(int(r["num_tokens"]) * top_k, num_experts)
            least = min(top_k, num_experts)
            if least <= found <= most or (is_rebuilt and found >= least):
                continue
            expected = f"{least}" if least == most else f"{least}..{most}"
            out.append(
                (
                    r["request_id"],
                    f"ledger incomplete at step {r['step_id']}: {found} expert uses in layer {layer} for "
                    f"{r['num_tokens']} token(s), the routing (top-{top_k}) gives {expected}",
                )
            )
    return out

"""KV events reconciled with what the ledger says really happened, not taken at their tag's word.

- a staged ``recompute`` (one that names its blocks) needs its step's rebuild pass for the request: the
  step_requests row's ``rebuild_objects`` (expert objects that pass computed); and a rebuild pass needs a
  staged ``recompute`` (else the blocks it rebuilt were labelled something else);
- a re-prefill ``recompute`` (no blocks named) needs its step's own forward to re-fill earlier positions,
  exactly the blocks those positions span, in every layer it names;
- an ``exact_load`` or ``kv_dequant`` names the tier of a copy the run could hold (host only with a host
  budget) and moved that copy's bytes (a full block, or the quantized size of its bits), of blocks whose
  positions were computed before the step (no copy exists of a block never filled); a request's adopted
  prefix (``requests.num_reused_tokens``) counts as computed before its first step.

Which spill wrote each copy, and whether each arbitration was served as chosen, are checked against the KV
store's copy journal in :mod:`fallbackgate.audit.kv_copies`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fallbackgate.engine.tags import Tag, Tier
from fallbackgate.ledger import audit_queries
from fallbackgate.ledger.db import Ledger

_RECOMPUTE, _EXACT, _DEQUANT = Tag.RECOMPUTE.value, Tag.EXACT_LOAD.value, Tag.KV_DEQUANT.value
_TIERS = {Tier.HOST.value, Tier.DISK.value}
Key = tuple[int, str]  # (step, request)


def _ids(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _positions(
    ledger: Ledger, run_id: int, reused: Mapping[str, int]
) -> tuple[dict[Key, dict[str, Any]], dict[Key, tuple[int, int]]]:
    """step_requests rows by (step, request), and per (step, request) (positions computed before the step,
    positions its own forward re-filled) from each request's rows in step order; a request's adopted prefix
    (`reused`: request id -> positions) counts as computed before its first step."""
    rows = audit_queries.step_request_positions(ledger, run_id)
    by_key = {(r["step_id"], r["request_id"]): r for r in rows}
    before: dict[Key, tuple[int, int]] = {}
    high: dict[str, int] = {}
    for r in rows:  # ordered by request, then step
        rid, start, n = r["request_id"], int(r["start_position"]), int(r["num_tokens"])
        mark = high.get(rid, reused.get(rid, 0))
        before[(r["step_id"], rid)] = (mark, max(0, min(start + n, mark) - start))
        high[rid] = max(mark, start + n)
    return by_key, before


def check_kv_events(
    ledger: Ledger, run_id: int, memory: Mapping[str, Any] | None, reused: Mapping[str, int] | None = None
) -> dict[str, list[str]]:
    """request id -> reasons its KV events contradict the run's record (see the module docstring);
    `reused`: request id -> prompt positions it adopted from kept prefix blocks (computed, though by no
    step of its own: a copy of them exists, which a later load or rebuild may read or replace)."""
    memory = memory or {}
    block_size = int(memory.get("block_size") or 0)
    by_key, before = _positions(ledger, run_id, reused or {})
    out: dict[str, list[str]] = {}

    def fail(rid: str, text: str) -> None:
        out.setdefault(rid, []).append(f"KV event mismatch: {text}")

    named = audit_queries.kv_event_objects(ledger, run_id)
    staged_recompute, dequant_bytes = _check_named_blocks(named, before, memory, fail)
    _check_rebuild_passes(by_key, {(s, r) for s, r, _ in staged_recompute}, fail)
    unnamed, moved = _check_copies_read(audit_queries.kv_events(ledger, run_id), memory, fail)
    for slot, num_bytes in moved.items():
        if slot in dequant_bytes and num_bytes != dequant_bytes[slot]:
            fail(
                slot[1],
                f"kv_dequant at step {slot[0]} (layer {slot[2]}) moved {num_bytes} B, its quantized "
                f"copies hold {dequant_bytes[slot]} B",
            )
    for slot, count in unnamed.items():
        _check_refill(
            slot, count - staged_recompute.get(slot, 0), before.get(slot[:2], (0, 0)), by_key, block_size, fail
        )
    return out


Slot = tuple[int, str, int]  # (step, request, layer)


def _check_named_blocks(
    named: Sequence[Mapping[str, Any]], before: Mapping[Key, tuple[int, int]], memory: Mapping[str, Any], fail: Any
) -> tuple[dict[Slot, int], dict[Slot, int]]:
    """Events that name their blocks: each block held a computed position before the step, and a dequant read
    a precision the run keeps. Returns blocks a staged recompute named and bytes the named dequant copies
    hold, per slot."""
    block_size = int(memory.get("block_size") or 0)
    object_bytes = memory.get("object_bytes") or {}
    staged_recompute: dict[Slot, int] = {}
    dequant_bytes: dict[Slot, int] = {}
    for o in named:
        key, ids = (o["step_id"], o["request_id"]), _ids(o["object_ids"])
        computed = before.get(key, (0, 0))[0]
        late = [i for i in ids if block_size and i * block_size >= computed]
        if late:
            fail(
                key[1],
                f"{o['tag']} at step {key[0]} (layer {o['layer']}) of blocks {late}, which held no computed "
                f"position before the step ({computed} computed): no copy of them existed",
            )
        slot = (key[0], key[1], o["layer"])  # one row per event: notes may split a slot's blocks over rows
        if o["tag"] == _RECOMPUTE and not o["is_rebuild"]:
            staged_recompute[slot] = staged_recompute.get(slot, 0) + len(ids)
        elif o["tag"] == _DEQUANT:
            size = (object_bytes.get(_DEQUANT) or {}).get(str(o["bits"]))
            if size is None:
                fail(
                    key[1],
                    f"kv_dequant at step {key[0]} (layer {o['layer']}) read {o['bits']}-bit copies, a "
                    f"precision the run keeps no quantized copy in",
                )
            dequant_bytes[slot] = dequant_bytes.get(slot, 0) + len(ids) * int(size or 0)
    return staged_recompute, dequant_bytes


def _check_copies_read(
    events: Sequence[Mapping[str, Any]], memory: Mapping[str, Any], fail: Any
) -> tuple[dict[Slot, int], dict[Slot, int]]:
    """Loads and dequants read a copy from a tier the run could hold, and a full load its block's bytes.
    Returns re-prefill recomputes' block counts and dequants' bytes moved, per slot."""
    object_bytes = memory.get("object_bytes") or {}
    unnamed: dict[Slot, int] = {}
    moved: dict[Slot, int] = {}
    for e in events:
        slot = (e["step_id"], e["request_id"], e["layer"])
        where = f"{e['tag']} at step {slot[0]} (layer {slot[2]})"
        if e["tag"] == _RECOMPUTE:
            unnamed[slot] = unnamed.get(slot, 0) + int(e["count"])
            continue
        if e["source_tier"] not in _TIERS or not e["bytes_moved"]:
            fail(
                slot[1],
                f"{where} loaded from tier {e['source_tier']} and moved {e['bytes_moved']} B: no copy "
                "in any tier was read",
            )
        elif e["source_tier"] == Tier.HOST.value and memory.get("host_budget_bytes") == 0:
            fail(slot[1], f"{where} names a host copy, but the run has no host budget to hold one")
        if e["tag"] == _EXACT and object_bytes.get("kv_block"):
            expected = int(e["count"]) * int(object_bytes["kv_block"])
            if e["bytes_moved"] and e["bytes_moved"] != expected:
                fail(slot[1], f"{where} moved {e['bytes_moved']} B for {e['count']} full block(s) of {expected} B")
        elif e["tag"] == _DEQUANT:
            moved[slot] = moved.get(slot, 0) + int(e["bytes_moved"] or 0)
    return unnamed, moved


def _check_rebuild_passes(by_key: Mapping[Key, Mapping[str, Any]], recomputed: set[Key], fail: Any) -> None:
    for key, row in by_key.items():
        objects = row["rebuild_objects"]
        if objects is None:  # recorded before the ledger kept rebuild passes
            continue
        if key in recomputed and not objects:
            fail(
                key[1],
                f"recompute at step {key[0]} names rebuilt blocks, but the step ran no rebuild pass for the request",
            )
        elif objects and key not in recomputed:
            fail(
                key[1],
                f"step {key[0]} ran a KV rebuild pass for the request ({objects} expert objects) that no "
                "recompute event names: the blocks it rebuilt are labelled otherwise",
            )


def _check_refill(
    slot: tuple[int, str, int],
    count: int,
    before: tuple[int, int],
    by_key: Mapping[Key, Mapping[str, Any]],
    block_size: int,
    fail: Any,
) -> None:
    """A re-prefill's recompute: the blocks its step's own forward re-filled, no more, no fewer."""
    if count <= 0 or not block_size:
        return
    row = by_key.get(slot[:2])
    if row is None:
        return  # the missing row is coverage's to report
    start, refilled = int(row["start_position"]), before[1]
    expected = (start + refilled - 1) // block_size - start // block_size + 1 if refilled else 0
    if count != expected:
        fail(
            slot[1],
            f"recompute at step {slot[0]} (layer {slot[2]}) counts {count} re-filled block(s), but the "
            f"step's forward re-filled {refilled} earlier position(s) ({expected} block(s))",
        )

"""KV events checked against the KV store's copy journal and the controller's arbitrations.

The engine notes, in order, every copy of a KV block it writes to host or disk, reads to serve a step and
frees (the ``kv_copies`` table, from each step's result). Checked here:

- the journal is whole: its changes add up to the number the engine handed out (``memory``);
- every read is of a copy written earlier in that tier and precision and not freed since (a kept prefix
  block's copy moves from the request that wrote it to the pseudo request ``prefix:<hash>`` and on to the
  request that adopts it: ``moved_out`` then ``moved_in``, each taking the copy the other named);
- the off-device KV events of each step × request × layer agree with the store's reads: an ``exact_load``
  from a tier counts the full-precision copies read there, a ``kv_dequant`` from a tier the quantized ones,
  and its named blocks are exactly those whose copies were read at its bits;
- every arbitration of a late KV block was served as chosen, for that block at that step: ``recompute`` and
  ``kv_dequant`` events name it, an ``exact_load`` read its full copy (or a failed checksum was recovered by
  recompute, as the event's note says). Observe mode decides nothing, so it has no arbitrations to check.

Per-layer staging reads each block inside the forward; its reads are noted and logged there, the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fallbackgate.engine.messages import CopyAction
from fallbackgate.engine.tags import Tag, Tier
from fallbackgate.ledger import audit_queries, kv_copy_queries
from fallbackgate.ledger.db import Ledger

_EXACT, _DEQUANT, _RECOMPUTE = Tag.EXACT_LOAD.value, Tag.KV_DEQUANT.value, Tag.RECOMPUTE.value
_WRITTEN, _READ, _FREED = CopyAction.WRITTEN.value, CopyAction.READ.value, CopyAction.FREED.value
_OUT, _IN = CopyAction.MOVED_OUT.value, CopyAction.MOVED_IN.value
_TIERS = (Tier.HOST.value, Tier.DISK.value)
_RECOVERED = "recovered by recompute"
Slot = tuple[int, str, int]  # (step, request, layer)
Reads = dict[Slot, dict[tuple[str, int], list[int]]]  # slot -> (tier, bits) -> blocks the store read
Fail = Callable[[str, str], None]


def _ids(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _copy(tier: str, bits: int) -> str:
    return f"{tier} {'full-precision' if not bits else f'{bits}-bit'} copy"


def check_kv_copies(
    ledger: Ledger, run_id: int, memory: Mapping[str, Any] | None, mode: str | None
) -> tuple[list[str], dict[str, list[str]]]:
    """(run-level reasons, request id -> reasons) where KV events, copies and arbitrations disagree."""
    expected = (memory or {}).get("num_kv_copy_changes")
    if expected is None:
        return [], {}  # recorded before the engine kept its copy journal
    out: dict[str, list[str]] = {}

    def fail(request_id: str, text: str) -> None:
        out.setdefault(request_id, []).append(f"KV event mismatch: {text}")

    changes = kv_copy_queries.kv_copy_changes(ledger, run_id)
    found = sum(len(_ids(c["block_ids"])) for c in changes)
    run_reasons = []
    if found != int(expected):
        run_reasons.append(
            f"ledger incomplete: the KV copy journal holds {found} of the {expected} copy changes the engine made"
        )
    reads = _replay_journal(changes, fail)
    dequantized, recomputed, recovered = _named_blocks(ledger, run_id)
    _check_events(ledger, run_id, reads, dequantized, fail)
    if mode != "observe":
        for a in kv_copy_queries.kv_arbitrations(ledger, run_id):
            slot = (a["step_id"], a["request_id"], a["layer"])
            block, choice = int(a["object_id"]), a["choice"]
            served = _served_as(slot, block, reads, dequantized, recomputed)
            if choice in served or (choice == _EXACT and _RECOMPUTE in served and slot in recovered):
                continue
            how = " and ".join(served) if served else "with no off-device action"
            fail(
                slot[1],
                f"arbitration at step {slot[0]} chose {choice} for KV block {block} (layer {slot[2]}), but the "
                f"step served it {how}",
            )
    return run_reasons, out


def _replay_journal(changes: list[dict[str, Any]], fail: Fail) -> Reads:
    """Walk the journal in order: each read must find its copy live; returns the reads per slot."""
    live: dict[tuple[str, int, int, str, int], int] = {}  # (request, layer, block, tier, bits) -> step written
    freed: dict[tuple[str, int, int, str, int], int] = {}  # the same -> step it was freed at
    reads: Reads = {}
    moving: list[tuple[int, str, int, int]] = []  # copies moved out and not yet in: (layer, tier, bits, step written)
    for c in changes:
        step, rid, layer, tier, bits = c["step_id"], c["request_id"], c["layer"], c["tier"], int(c["bits"])
        for block in _ids(c["block_ids"]):
            key = (rid, layer, block, tier, bits)
            if c["action"] == _WRITTEN:
                live[key] = step
                freed.pop(key, None)
            elif c["action"] == _OUT:
                if key not in live:
                    fail(rid, f"step {step} moved out the {_copy(tier, bits)} of KV block {block} (layer {layer}), "
                              "which is not live")  # fmt: skip
                    continue
                moving.append((layer, tier, bits, live.pop(key)))
            elif c["action"] == _IN:
                if not moving or moving[0][:3] != (layer, tier, bits):
                    fail(rid, f"step {step} moved in a {_copy(tier, bits)} of KV block {block} (layer {layer}) that "
                              "no moved_out handed over")  # fmt: skip
                    continue
                live[key] = moving.pop(0)[3]
                freed.pop(key, None)
            elif c["action"] == _FREED:
                if live.pop(key, None) is None:
                    fail(rid, f"step {step} freed the {_copy(tier, bits)} of KV block {block} (layer {layer}), "
                              "which was never written")  # fmt: skip
                freed[key] = step
            else:
                if key not in live:
                    why = f"freed at step {freed[key]}" if key in freed else "never written"
                    fail(
                        rid,
                        f"step {step} read the {_copy(tier, bits)} of KV block {block} (layer {layer}), a copy {why}",
                    )
                reads.setdefault((step, rid, layer), {}).setdefault((tier, bits), []).append(block)
    return reads


def _named_blocks(
    ledger: Ledger, run_id: int
) -> tuple[dict[Slot, dict[int, list[int]]], dict[Slot, set[int]], set[Slot]]:
    """Blocks kv_dequant events name per slot and bits; blocks recompute events name per slot; and the
    slots whose recompute recovered a failed read."""
    dequantized: dict[Slot, dict[int, list[int]]] = {}
    recomputed: dict[Slot, set[int]] = {}
    for o in audit_queries.kv_event_objects(ledger, run_id):
        slot = (o["step_id"], o["request_id"], o["layer"])
        if o["tag"] == _DEQUANT:
            dequantized.setdefault(slot, {}).setdefault(int(o["bits"]), []).extend(_ids(o["object_ids"]))
        elif o["tag"] == _RECOMPUTE:
            recomputed.setdefault(slot, set()).update(_ids(o["object_ids"]))
    recovered = {
        (e["step_id"], e["request_id"], e["layer"])
        for e in audit_queries.kv_events(ledger, run_id)
        if e["tag"] == _RECOMPUTE and _RECOVERED in (e["note"] or "")
    }
    return dequantized, recomputed, recovered


def _check_events(
    ledger: Ledger, run_id: int, reads: Reads, dequantized: Mapping[Slot, dict[int, list[int]]], fail: Fail
) -> None:
    """Per slot: blocks each event loaded from a tier against the store's reads there, named blocks against
    the blocks read at their bits."""
    served: dict[Slot, dict[tuple[str, str], int]] = {}  # slot -> (tag, tier) -> blocks the events count
    for e in audit_queries.kv_events(ledger, run_id):
        if e["tag"] in (_EXACT, _DEQUANT) and e["source_tier"] in _TIERS:
            counts = served.setdefault((e["step_id"], e["request_id"], e["layer"]), {})
            key = (e["tag"], e["source_tier"])
            counts[key] = counts.get(key, 0) + int(e["count"])
    for slot in sorted(set(served) | set(reads) | set(dequantized)):
        store, counts = reads.get(slot, {}), served.get(slot, {})
        where = f"at step {slot[0]} (layer {slot[2]})"
        for tier in _TIERS:
            for tag, is_quant in ((_EXACT, False), (_DEQUANT, True)):
                got = [b for (t, bits), ids in store.items() if t == tier and bool(bits) is is_quant for b in ids]
                named = counts.get((tag, tier), 0)
                if named != len(got):
                    kind = "quantized" if is_quant else "full-precision"
                    fail(
                        slot[1],
                        f"{tag} {where} counts {named} block(s) from {tier}, the KV store read {len(got)} {kind} "
                        f"{tier} copies there (blocks {sorted(got)})",
                    )
        named_bits = dequantized.get(slot, {})
        for bits in sorted(set(named_bits) | {b for _, b in store if b}):
            read = sorted(b for (_, b_bits), ids in store.items() if b_bits == bits for b in ids)
            if sorted(named_bits.get(bits, [])) != read:
                fail(
                    slot[1],
                    f"kv_dequant {where} names blocks {sorted(named_bits.get(bits, []))} at {bits} bits, the KV "
                    f"store read {bits}-bit copies of blocks {read}",
                )


def _served_as(
    slot: Slot,
    block: int,
    reads: Reads,
    dequantized: Mapping[Slot, dict[int, list[int]]],
    recomputed: Mapping[Slot, set[int]],
) -> list[str]:
    """The tags block `block` of the slot was served with: its full copy read, dequantized, or rebuilt."""
    served = []
    if any(block in ids for (_, bits), ids in reads.get(slot, {}).items() if not bits):
        served.append(_EXACT)
    if any(block in ids for ids in dequantized.get(slot, {}).values()):
        served.append(_DEQUANT)
    if block in recomputed.get(slot, set()):
        served.append(_RECOMPUTE)
    return served

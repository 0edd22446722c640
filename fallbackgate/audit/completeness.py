"""Completeness: a run passes only when its ledger holds everything the engine said it did.

Checked against what the engine counted itself, never against the rows alone:

- a run with no requests never passes;
- per step: the event rows found against the step row's ``num_events``, and a row for every step that
  sampled an audited token;
- per step × request: event rows and objects found against the ``step_requests`` row;
- counted resident uses (no event rows) against the step rows and the routing (:mod:`fallbackgate.audit.use_counts`);
- from the engine's side (:mod:`fallbackgate.audit.coverage`): a row for every (step, request) the steps
  scheduled, positions that tile each request, a sampling row per output token, no orphan rows;
- KV events against the recorded rebuild passes, positions and copies (:mod:`fallbackgate.audit.kv_reconcile`),
  and against the KV store's copy journal and the arbitrations (:mod:`fallbackgate.audit.kv_copies`);
- per request: objects per tag found against the engine's own ``tag_counts``;
- every tag ``--force`` turned on produced events (in observe mode: events whose note says the controller
  would have served it);
- every weight copy checked against the checkpoint (sampled expert copies, dense weights) matched;
- bytes per tag: bytes moved are whole objects of the size the tag implies (a full expert for ``exact_load``
  and ``cpu_execute``: its compute-dtype bytes from a memory copy, the checkpoint's stored bytes from a disk
  read, which differ for an FP8 checkpoint or a ``--dtype`` override; a low-bit copy for ``expert_lowbit``,
  a KV block, a quantized KV block for ``kv_dequant``); a mismatch names the tag whose size the bytes do fit.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from fallbackgate.audit.coverage import check_coverage
from fallbackgate.audit.kv_copies import check_kv_copies
from fallbackgate.audit.kv_reconcile import check_kv_events
from fallbackgate.audit.use_counts import check_use_counts
from fallbackgate.engine.tags import ObjectKind, Tag
from fallbackgate.ledger import audit_queries, queries
from fallbackgate.ledger.db import Ledger

MAX_LISTED = 10  # step ids named in one reason

_EXPERT, _KV_BLOCK = ObjectKind.EXPERT.value, ObjectKind.KV_BLOCK.value
CHECKPOINT_READ = "expert_checkpoint_read"  # object_bytes key: bytes of one expert as the checkpoint stores it
_WOULD_SERVE = re.compile(r"observe: would serve (\w+)")


@dataclasses.dataclass
class Completeness:
    """What is missing or inconsistent in a run's ledger."""

    reasons: list[str] = dataclasses.field(default_factory=list)  # run-level reasons
    missing_step_ids: list[int] = dataclasses.field(default_factory=list)  # steps with missing or extra rows
    missing_pairs: list[tuple[int, str]] = dataclasses.field(default_factory=list)  # (step, request) rows missing
    request_reasons: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # request id -> reasons


def _listed(ids: list[int]) -> str:
    more = f" and {len(ids) - MAX_LISTED} more" if len(ids) > MAX_LISTED else ""
    return ", ".join(map(str, ids[:MAX_LISTED])) + more


def check_completeness(ledger: Ledger, run: Mapping[str, Any], requests: list[dict[str, Any]]) -> Completeness:
    """Reconcile the run's rows with the engine's own counts (see the module docstring)."""
    out = Completeness()
    run_id = int(run["id"])
    if not requests:
        out.reasons.append("run has no requests: nothing was served, so nothing can pass")
    _check_steps(ledger, run_id, out)
    _check_requests(ledger, run_id, requests, out)
    coverage = check_coverage(ledger, run_id, requests)
    out.reasons += coverage.reasons
    out.missing_pairs = coverage.missing_pairs
    out.missing_step_ids = sorted(set(out.missing_step_ids) | set(coverage.short_step_ids))
    for rid, reasons in coverage.request_reasons.items():
        out.request_reasons.setdefault(rid, []).extend(reasons)
    reused = {r["request_id"]: int(r.get("num_reused_tokens") or 0) for r in requests}
    kv_reasons = check_kv_events(ledger, run_id, run.get("memory"), reused)
    copy_reasons, by_request = check_kv_copies(ledger, run_id, run.get("memory"), run.get("mode"))
    out.reasons += copy_reasons
    for rid, reasons in by_request.items():
        kv_reasons.setdefault(rid, []).extend(reasons)
    for rid, reasons in kv_reasons.items():
        out.request_reasons.setdefault(rid, []).extend(reasons)
    if kv_reasons:
        first = next(iter(kv_reasons.values()))[0]
        out.reasons.append(f"{sum(map(len, kv_reasons.values()))} KV event(s) contradict the ledger, first: {first}")
    count_reasons, count_request_reasons = check_use_counts(ledger, run_id, run.get("memory"))
    out.reasons += count_reasons
    for rid, reasons in count_request_reasons.items():
        out.request_reasons.setdefault(rid, []).extend(reasons)
    out.reasons += _forced_tag_reasons(ledger, run)
    memory = run.get("memory") or {}
    is_ram = memory.get("tier_layout") == "ram_disk"  # a CPU: a low-bit copy crosses no link after the disk
    out.reasons += check_object_bytes(ledger, run_id, memory.get("object_bytes"), is_ram)
    out.reasons += [_verification_reason(v) for v in audit_queries.failed_verifications(ledger, run_id)]
    pending = audit_queries.num_pending_audits(ledger, run_id)
    if pending:
        out.reasons.append(f"audit pending: {pending} request(s) not audited yet (run `fallbackgate audit`)")
    return out


def _forced_tag_reasons(ledger: Ledger, run: Mapping[str, Any]) -> list[str]:
    """A forced tag with no events fails; in observe mode the controller's noted decisions count (it serves
    exactly and notes "would serve TAG")."""
    run_id = int(run["id"])
    by_tag: dict[str, int] = {}
    for r in queries.run_tag_counts(ledger, run_id):
        by_tag[r["tag"]] = by_tag.get(r["tag"], 0) + int(r["objects"] or 0)
    would: dict[str, int] = {}
    if run.get("mode") == "observe":
        for r in audit_queries.observe_notes(ledger, run_id):
            for tag in _WOULD_SERVE.findall(r["note"] or ""):
                would[tag] = would.get(tag, 0) + int(r["objects"] or 0)
    reasons = []
    for tag in run.get("forced_tags") or []:
        if not by_tag.get(tag) and not would.get(tag):
            what = (
                "the controller neither served nor decided it"
                if run.get("mode") == "observe"
                else ("the run did not exercise it")
            )
            reasons.append(f"forced tag {tag} produced no events: {what}")
    return reasons


def _verification_reason(v: Mapping[str, Any]) -> str:
    where = f" after step {v['step_id']}" if v["step_id"] is not None else " at audit"
    tier = v["tier"] or "audit"  # no tier: the audit's own copy
    what = f"expert {v['name']} ({tier} copy)" if v["object_kind"] == _EXPERT else f"dense weight {v['name']}"
    return f"weight copy corrupt: {what} failed its check against the checkpoint{where}: {v['note']}"


def _check_steps(ledger: Ledger, run_id: int, out: Completeness) -> None:
    counts = audit_queries.step_event_counts(ledger, run_id)
    known = [c for c in counts if c["expected"] is not None]
    short = [c for c in known if c["found"] != c["expected"]]
    if short:
        expected, found = sum(c["expected"] for c in short), sum(c["found"] for c in short)
        ids = [c["step_id"] for c in short]
        out.missing_step_ids += ids
        out.reasons.append(
            f"ledger incomplete: event rows of steps {_listed(ids)} do not match the engine's count "
            f"(expected {expected}, found {found})"
        )
    absent = audit_queries.steps_referenced_but_absent(ledger, run_id)
    if absent:
        out.missing_step_ids += absent
        out.reasons.append(f"ledger incomplete: no rows for steps {_listed(absent)}, which sampled audited tokens")
    rows = audit_queries.step_request_counts(ledger, run_id)
    bad = [r for r in rows if (r["found_events"], r["found_objects"]) != (r["num_events"], r["num_objects"])]
    for r in bad:
        out.request_reasons.setdefault(r["request_id"], []).append(
            f"ledger incomplete at step {r['step_id']}: {r['found_events']} of {r['num_events']} event rows, "
            f"{r['found_objects']} of {r['num_objects']} objects"
        )
    out.missing_step_ids = sorted(set(out.missing_step_ids) | {r["step_id"] for r in bad})


def _check_requests(ledger: Ledger, run_id: int, requests: list[dict[str, Any]], out: Completeness) -> None:
    found = queries.request_tags(ledger, run_id)
    for req in requests:
        engine_counts = {t: n for t, n in (req.get("tag_counts") or {}).items() if n}
        if not engine_counts:  # not counted (a synthetic request); an engine request always has objects
            continue
        ledger_counts = {t: n for t, n in found.get(req["request_id"], {}).items() if n}
        if ledger_counts != engine_counts:
            diff = {
                t: f"{ledger_counts.get(t, 0)} of {engine_counts.get(t, 0)}"
                for t in sorted(set(engine_counts) | set(ledger_counts))
                if ledger_counts.get(t, 0) != engine_counts.get(t, 0)
            }
            out.request_reasons.setdefault(req["request_id"], []).append(
                "ledger incomplete: objects per tag in the ledger against the engine's count: "
                + ", ".join(f"{t} {v}" for t, v in diff.items())
            )


def _sizes(object_bytes: Mapping[str, Any]) -> dict[tuple[str, str, int], int]:
    """(object kind, tag, bits) -> bytes of one object moved with that tag."""
    sizes = {}
    expert, block = int(object_bytes[_EXPERT]), int(object_bytes[_KV_BLOCK])
    read = _checkpoint_read(object_bytes)
    for tag in (Tag.EXACT_LOAD, Tag.CPU_EXECUTE):
        sizes[(_EXPERT, tag.value, 0)] = expert  # from a memory copy: the compute dtype's bytes
        if read != expert:  # from the checkpoint: the bytes the files store (FP8 codes and scales, another dtype)
            sizes[(_EXPERT, tag.value, -1)] = read
    sizes[(_KV_BLOCK, Tag.EXACT_LOAD.value, 0)] = block
    for bits, n in (object_bytes.get(Tag.EXPERT_LOWBIT.value) or {}).items():
        sizes[(_EXPERT, Tag.EXPERT_LOWBIT.value, int(bits))] = int(n)
    for bits, n in (object_bytes.get(Tag.KV_DEQUANT.value) or {}).items():
        sizes[(_KV_BLOCK, Tag.KV_DEQUANT.value, int(bits))] = int(n)
    return sizes


def _checkpoint_read(object_bytes: Mapping[str, Any]) -> int:
    """Bytes one expert read from the checkpoint moves (a run recorded before they were kept: the expert's)."""
    return int(object_bytes.get(CHECKPOINT_READ) or object_bytes[_EXPERT])


def _fits(num_bytes: int, num_objects: int, sizes: list[int], extra: int | None, is_extra_only: bool = False) -> bool:
    """Whether `num_bytes` is 1..num_objects objects, each of one of `sizes` (at most two distinct sizes: a
    KV block quantized to int8 or int4), plus any whole `extra`-byte reads (a low-bit copy made from a disk
    read moves the full expert too); `is_extra_only`: the reads alone may make up the bytes (on a CPU a
    low-bit copy is computed with in RAM, where it was made: only its disk read moved bytes)."""
    first, second = sizes[0], sizes[1] if len(sizes) > 1 else None
    for count in range(0 if is_extra_only and extra else 1, num_objects + 1):
        for num_second in range(count + 1 if second else 1):
            rest = num_bytes - (count - num_second) * first - num_second * (second or 0)
            if rest == 0 or (extra and rest > 0 and rest % extra == 0):
                return True
    return False


def check_object_bytes(
    ledger: Ledger, run_id: int, object_bytes: Mapping[str, Any] | None, is_ram_tiered: bool = False
) -> list[str]:
    """Reasons for every step × request × layer whose bytes do not fit its tag's object size
    (`is_ram_tiered`: a CPU run, where an expert_lowbit event moves only the disk reads it made)."""
    if not object_bytes:
        return []
    by_tag: dict[tuple[str, str], list[int]] = {}
    for (kind, tag, _), n in _sizes(object_bytes).items():
        by_tag.setdefault((kind, tag), []).append(n)
    reasons = []
    for r in audit_queries.moved_bytes(ledger, run_id):
        kind, tag, num_bytes, num_objects = r["object_kind"], r["tag"], int(r["bytes_moved"]), int(r["objects"])
        sizes = by_tag.get((kind, tag))
        lowbit_read = _checkpoint_read(object_bytes)  # a low-bit copy made from a disk read
        extra = lowbit_read if tag == Tag.EXPERT_LOWBIT.value else None
        if sizes and _fits(num_bytes, num_objects, sizes, extra, is_ram_tiered):
            continue
        fitting = [
            f"{t} ({' or '.join(map(str, ns))} B each)"
            for (k, t), ns in by_tag.items()
            if k == kind and t != tag and _fits(num_bytes, num_objects, ns, None)
        ]
        hint = f"; the bytes fit {', '.join(fitting)}" if fitting else ""
        expected = f"{' or '.join(map(str, sizes))} B each" if sizes else "no known size"
        reasons.append(
            f"mislabelled tag at step {r['step_id']} (request {r['request_id']}, layer {r['layer']}): {tag} moved "
            f"{num_bytes} B for {num_objects} {kind} object(s), {expected}{hint}"
        )
    return reasons

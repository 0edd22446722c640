"""The kv_copies table read back: the KV store's copy journal of a run, and its KV arbitrations."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from fallbackgate.engine.messages import CopyAction
from fallbackgate.engine.tags import ObjectKind
from fallbackgate.ledger.db import Ledger
from fallbackgate.ledger.models import ArbitrationRow, KVCopyRow
from fallbackgate.ledger.queries import _all


def kv_copy_changes(ledger: Ledger, run_id: int) -> list[dict[str, Any]]:
    """Every copy change of the run (written, read, freed), in the order the KV store made them."""
    c = KVCopyRow
    cols = (c.step_id, c.seq, c.request_id, c.layer, c.action, c.tier, c.bits, c.block_ids, c.num_bytes)
    return _all(ledger, select(*cols).where(c.run_id == run_id).order_by(c.seq))


def written_code_checksums(ledger: Ledger, run_id: int, request_id: str) -> list[dict[str, Any]]:
    """One request's quantized KV copies written with their codes' checksums, in write order."""
    c = KVCopyRow
    cols = (c.step_id, c.layer, c.bits, c.block_ids, c.code_checksums)
    written = (c.action == CopyAction.WRITTEN.value) & c.code_checksums.is_not(None)
    stmt = select(*cols).where(c.run_id == run_id, c.request_id == request_id, written)
    return _all(ledger, stmt.order_by(c.seq))


def kv_arbitrations(ledger: Ledger, run_id: int) -> list[dict[str, Any]]:
    """The run's arbitrations of late KV blocks: which block, at which step, and the tag chosen."""
    a = ArbitrationRow
    cols = (a.step_id, a.request_id, a.layer, a.object_id, a.choice)
    stmt = select(*cols).where(a.run_id == run_id, a.object_kind == ObjectKind.KV_BLOCK.value).order_by(a.id)
    return _all(ledger, stmt)


def request_copy_changes(ledger: Ledger, run_id: int, request_id: str) -> list[dict[str, Any]]:
    """One request's copy changes (written, read, freed, moved), in the order the KV store made them."""
    c = KVCopyRow
    cols = (c.step_id, c.action, c.layer, c.tier, c.bits, c.block_ids)
    stmt = select(*cols).where(c.run_id == run_id, c.request_id == request_id)
    return _all(ledger, stmt.order_by(c.seq))

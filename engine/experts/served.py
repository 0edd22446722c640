"""What the dispatch hands the step's log: one event per served (expert, request) use, and the pieces of a
layer's rows as they are computed."""

from __future__ import annotations

import numpy as np
import torch

from fallbackgate.engine.experts.hook import ExpertUse
from fallbackgate.engine.experts.store import ExpertKey, ExpertStore, Fetched
from fallbackgate.engine.step_context import StepContext
from fallbackgate.engine.tags import ObjectKind, Tag, Tier


class LayerRows:
    """A layer's weighted (token, top-k) rows as they are computed, possibly in several kernel calls."""

    def __init__(self, num_rows: int) -> None:
        self.rows: torch.Tensor | None = None
        self.is_done = np.zeros(num_rows, dtype=bool)

    def put(self, index: np.ndarray, values: torch.Tensor) -> None:
        """Rows `index` get `values` (full ``[T * k, H]`` when `index` covers every row computed by a kernel)."""
        if self.rows is None:
            self.rows = torch.zeros((len(self.is_done), values.shape[-1]), dtype=values.dtype, device=values.device)
        idx = torch.as_tensor(index, device=self.rows.device)
        self.rows.index_copy_(0, idx, values.to(self.rows.dtype))
        self.is_done[index] = True


def group_by_key(uses: list[ExpertUse]) -> dict[ExpertKey, list[ExpertUse]]:
    """Uses grouped by expert, in first-use order."""
    grouped: dict[ExpertKey, list[ExpertUse]] = {}
    for use in uses:
        grouped.setdefault(use.key, []).append(use)
    return grouped


def record_fetched(
    ctx: StepContext,
    store: ExpertStore,
    uses: list[ExpertUse],
    fetch_tag: Tag,
    fetched: Fetched,
    transfer_s: float,
    wait_ns: int,
) -> None:
    """The first use carries the fetch (bytes, source, modeled and measured time); later uses reuse the
    fetched weights."""
    first, *rest = uses
    moved = fetched.bytes_moved
    tier = fetched.source_tier if moved else None
    record_use(ctx, store, first, fetch_tag, moved, tier, transfer_s, fetched.note, wait_ns)
    reused = Tag.RESIDENT if fetch_tag is Tag.EXACT_LOAD else fetch_tag
    for use in rest:
        record_use(ctx, store, use, reused, 0, None, 0.0, "", 0)


def record_use(
    ctx: StepContext,
    store: ExpertStore,
    use: ExpertUse,
    tag: Tag,
    moved: int,
    tier: Tier | None,
    modeled_s: float,
    note: str,
    wait_ns: int,
) -> None:
    """One use's event in the step's log (and, when capturing, what it was served from); the note carries
    the controller's reason and, observing, what it would have served."""
    request_id = ctx.batch.request_ids[use.request_index]
    if ctx.log.capture is not None and (tag is not Tag.RESIDENT or moved):
        before = tier if moved and tier is not None else store.home(use.key)
        call = len(ctx.log.capture.routing) - 1
        ctx.log.capture.expert_served.append((call, use.key[1], request_id, before, tag, moved, wait_ns))
    decided = use.decision.tag
    if decided is not Tag.RESIDENT and use.decision.reason:
        note = (note + "; " if note else "") + use.decision.reason
    if ctx.is_observe and decided not in (Tag.RESIDENT, Tag.EXACT_LOAD, tag):
        note = (note + "; " if note else "") + f"observe: would serve {decided.value}"
    cost = use.decision.predicted_cost if not ctx.is_observe or use.decision.is_forced else 0.0  # what was served
    ctx.log.add(
        request_id,
        use.key[0],
        ObjectKind.EXPERT,
        tag,
        bytes_moved=moved,
        source_tier=tier,
        predicted_cost=cost,
        modeled_s=modeled_s,
        note=note,
        object_id=use.key[1] if tag.is_approximate else None,
        bits=store.lowbit_bits if tag is Tag.EXPERT_LOWBIT else 0,
    )

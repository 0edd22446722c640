"""Synthetic engine messages with real tag values, for the ledger's tests and benchmark."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from fallbackgate.engine.messages import Event, RequestOutput, StepKind, StepPlan, StepResult
from fallbackgate.engine.tags import EXPERT_TAGS, KV_TAGS, ObjectKind, Tag, Tier

_EXPERT_TAGS = sorted(EXPERT_TAGS, key=lambda t: t.value)
_KV_TAGS = sorted(KV_TAGS, key=lambda t: t.value)


def synthetic_step(
    step_id: int,
    request_ids: list[str],
    *,
    num_layers: int = 4,
    events_per_layer: int = 2,
    rng: random.Random | None = None,
    tags: Sequence[str] | None = None,
) -> tuple[StepPlan, StepResult]:
    """A decode step over ``request_ids`` with ``num_layers * events_per_layer`` events per request.

    Tags cycle through ``tags`` (default: every expert and KV tag); each request samples one token.
    """
    rng = rng or random.Random(step_id)
    plan = StepPlan(
        step_id=step_id,
        kind=StepKind.DECODE,
        request_ids=list(request_ids),
        num_tokens={r: 1 for r in request_ids},
        start_positions={r: 10 + step_id for r in request_ids},
    )
    events: list[Event] = []
    i = 0
    for rid in request_ids:
        for layer in range(num_layers):
            for _ in range(events_per_layer):
                events.append(_event(step_id, rid, layer, i, rng, tags))
                i += 1
    result = StepResult(
        step_id=step_id,
        kind=StepKind.DECODE,
        request_ids=list(request_ids),
        sampled_token_ids={r: rng.randrange(100) for r in request_ids},
        logits={},
        events=events,
        wall_s=0.01,
        modeled_s=0.012,
        num_device_bytes_expert=3 << 30,
        num_device_bytes_kv=1 << 30,
    )
    return plan, result


def _event(
    step_id: int,
    rid: str,
    layer: int,
    i: int,
    rng: random.Random,
    tags: Sequence[str] | None,
) -> Event:
    if tags is not None:
        tag = Tag(tags[i % len(tags)])
        kind = ObjectKind.EXPERT if tag in EXPERT_TAGS else ObjectKind.KV_BLOCK
    elif i % 2 == 0:
        tag, kind = _EXPERT_TAGS[i // 2 % len(_EXPERT_TAGS)], ObjectKind.EXPERT
    else:
        tag, kind = _KV_TAGS[i // 2 % len(_KV_TAGS)], ObjectKind.KV_BLOCK
    moved = tag is Tag.EXACT_LOAD
    return Event(
        step_id=step_id,
        request_id=rid,
        layer=layer,
        object_kind=kind,
        tag=tag,
        count=1 + i % 3,
        bytes_moved=(1 << 20) if moved else 0,
        source_tier=Tier.HOST if moved else None,
        predicted_cost=0.01 * rng.random() if tag.is_approximate else 0.0,
        modeled_s=1e-4,
    )


def synthetic_output(
    request_id: str, num_output: int = 5, vocab: int = 16, tag_counts: dict[str, int] | None = None
) -> RequestOutput:
    """A finished request with ``num_output`` tokens and random logits; ``tag_counts`` is the engine's own
    count of objects per tag (empty: not counted, so completeness does not reconcile it)."""
    gen = torch.Generator().manual_seed(len(request_id))
    return RequestOutput(
        request_id=request_id,
        request_class="default",
        prompt_token_ids=[1, 2, 3],
        output_token_ids=list(range(num_output)),
        output_logits=torch.randn(num_output, vocab, generator=gen),
        arrival_s=100.0,
        first_token_s=100.5,
        finish_s=100.5 + 0.1 * (num_output - 1),
        modeled_ttft_s=0.4,
        modeled_tpot_s=0.09,
        tag_counts=dict(tag_counts or {}),
    )

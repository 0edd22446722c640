"""What a step hands back per request: sampled tokens, kept logits, tag counts, and finished outputs."""

from __future__ import annotations

import torch

from fallbackgate.engine.messages import Event, RequestOutput
from fallbackgate.engine.sampler import rows_logprobs, sample, top_logprobs
from fallbackgate.engine.sequence import Sequence
from fallbackgate.engine.step_context import EventLog
from fallbackgate.engine.tags import ObjectKind, Tag

Rows = dict[str, torch.Tensor]


def sample_rows(
    chosen: list[tuple[Sequence, int]], logits: torch.Tensor, failed: dict[str, str]
) -> tuple[dict[str, int], Rows, Rows]:
    """Advance each chosen request by the tokens it ran; sample those at their end. Returns the sampled
    tokens, the rows kept for the step result (requests keeping logits) and each sampled request's own row."""
    sampled, kept, own = {}, {}, {}
    row = 0
    for seq, num in chosen:
        seq.num_computed_tokens += num
        if seq.num_computed_tokens == seq.num_tokens:
            # every running request keeps a copy of its own row (a view would hold the whole step's logits):
            # whether it is audited by risk is known only when it ends; `request_output` drops the rest
            if seq.request_id in failed:  # a fault only it met: its row is not its model's output
                row += 1
                continue
            own[seq.request_id] = logits[row].detach().to("cpu", copy=True)
            if seq.is_logits_kept:
                kept[seq.request_id] = own[seq.request_id]
            token = sampled[seq.request_id] = sample(logits[row], seq.params, seq.generator)
            if seq.params.num_top_logprobs is not None:  # computed now: the full row is not kept
                seq.output_logprobs.append(top_logprobs(logits[row], token, seq.params.num_top_logprobs))
            row += 1
    return sampled, kept, own


def count_tags(sequences: dict[str, Sequence], log: EventLog, events: list[Event]) -> None:
    """Add the step's events and resident expert uses to each unfinished request's tag counts."""
    for event in events:
        if event.request_id in sequences:
            seq = sequences[event.request_id]
            seq.tag_counts[event.tag.value] = seq.tag_counts.get(event.tag.value, 0) + event.count
            if event.object_kind is ObjectKind.KV_BLOCK and event.tag is not Tag.RESIDENT:
                seq.has_off_device_kv = True
    for request_id, by_layer in log.expert_resident_uses.items():
        if request_id in sequences:
            counts = sequences[request_id].tag_counts
            counts[Tag.RESIDENT.value] = counts.get(Tag.RESIDENT.value, 0) + sum(by_layer.values())


def keep_prompt_logprobs(prompt_rows: list[tuple[Sequence, int, int]], logits: torch.Tensor) -> None:
    """Each asked prompt position's log-probability of the token after it (and its top-k), from `logits`
    [len(prompt_rows), vocab] in one log-softmax per request; the rows themselves are not kept."""
    start = 0
    while start < len(prompt_rows):
        seq = prompt_rows[start][0]
        stop = start
        while stop < len(prompt_rows) and prompt_rows[stop][0] is seq:
            stop += 1
        positions = [p for _, p, _ in prompt_rows[start:stop]]
        targets = [seq.prompt_token_ids[p + 1] for p in positions]
        k = seq.params.num_prompt_logprobs or 0
        for position, got in zip(positions, rows_logprobs(logits[start:stop], targets, k), strict=True):
            seq.prompt_logprobs[position] = got
        start = stop


def is_kept(seq: Sequence) -> bool:
    """Whether a request's output logits survive its end: asked for, or it read KV off device (audited by risk)."""
    return seq.is_logits_kept or seq.has_off_device_kv


def request_output(seq: Sequence) -> RequestOutput:
    """The output of a request as it stands now (finished, cancelled or aborted)."""
    n = len(seq.output_token_ids)
    tpot = (seq.modeled_finish_s - seq.modeled_first_token_s) / (n - 1) if n > 1 else 0.0
    return RequestOutput(
        seq.request_id,
        seq.request_class,
        seq.prompt_token_ids,
        list(seq.output_token_ids),
        torch.stack(seq.output_logits) if seq.output_logits and is_kept(seq) else None,
        seq.arrival_s,
        seq.first_token_s,
        seq.finish_s,
        seq.modeled_first_token_s - seq.modeled_arrival_s,
        tpot,
        dict(seq.tag_counts),
        seq.num_preemptions,
        seq.pop_prompt_logits(),
        seq.output_logprobs if seq.params.num_top_logprobs is not None else None,
        seq.pop_prompt_logprobs(),
        seq.num_reused_tokens,
    )

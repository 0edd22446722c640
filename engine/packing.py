"""Packing one step's chosen requests into the token rows of a single forward."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fallbackgate.engine.kv.prefix_cache import PrefixCache
from fallbackgate.engine.sequence import Sequence
from fallbackgate.engine.step_context import EventLog, ForwardBatch, log_rebuilt

Positions = list[tuple[Sequence, int, int]]  # (sequence, prompt position, packed row)


@dataclass
class PackedStep:
    """The packed tokens of a step, the rows sampled from, and the prompt rows kept for scoring/logprobs."""

    batch: ForwardBatch
    token_ids: list[int]
    rows: list[int]  # packed rows of requests that reach their end this step (sampled from)
    scored: Positions  # prompt logits kept for scoring
    prompt_rows: Positions  # prompt logprobs asked


def pack_step(
    chosen: list[tuple[Sequence, int]], log: EventLog, prefix: PrefixCache, block_size: int, num_layers: int
) -> PackedStep:
    """Pack each chosen (sequence, tokens to run) in order; log the KV it rebuilds (and, when capturing, reads)."""
    token_ids: list[int] = []
    owners: list[int] = []
    rows: list[int] = []
    scored: Positions = []
    prompt_rows: Positions = []
    for index, (seq, num) in enumerate(chosen):
        start = seq.num_computed_tokens
        offset = len(token_ids)
        if log.capture is not None:
            log.capture.kv_reads.append((seq.request_id, -(-(start + num) // block_size)))
            log.capture.kv_hashes[seq.request_id] = prefix.read_hashes(seq, start + num)
        token_ids += seq.all_token_ids[start : start + num]
        owners += [index] * num
        if start + num == seq.num_tokens:
            rows.append(len(token_ids) - 1)
        kept = seq.scored_positions
        scored += [(seq, p, offset + p - start) for p in range(max(start, kept.start), min(start + num, kept.stop))]
        if seq.params.num_prompt_logprobs is not None:
            end = min(start + num, len(seq.prompt_token_ids) - 1)  # the last prompt position predicts an output
            prompt_rows += [(seq, p, offset + p - start) for p in range(start, end)]
        log_rebuilt(log, seq.request_id, start, min(start + num, seq.num_recompute_tokens), block_size, num_layers)
    batch = ForwardBatch(
        [s.request_id for s, _ in chosen],
        [s.num_computed_tokens for s, _ in chosen],
        [n for _, n in chosen],
        torch.tensor(owners),
        [s.request_class for s, _ in chosen],
    )
    return PackedStep(batch, token_ids, rows, scored, prompt_rows)

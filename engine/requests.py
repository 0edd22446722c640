"""Request admission: the checks a request passes, the model length limit, and the sequence it becomes."""

from __future__ import annotations

from typing import Any

import torch

from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.errors import PromptError
from fallbackgate.engine.sequence import SamplingParams, Sequence, check_prompt


def max_model_len(config: EngineConfig, model_config: Any) -> int:
    """Tokens per request the engine accepts: the configured max_model_len capped by the model's positions."""
    positions = getattr(model_config, "max_position_embeddings", None)
    return min(config.max_model_len, int(positions)) if positions else config.max_model_len


def length_limit_reason(config: EngineConfig, model_config: Any) -> str:
    """Where `max_model_len` comes from, for messages ("min(max_model_len 4096, max_position_embeddings 1024)")."""
    positions = getattr(model_config, "max_position_embeddings", None)
    if not positions:
        return f"max_model_len {config.max_model_len} (the model states no position limit)"
    capped = " (capped by the model's positions)" if int(positions) < config.max_model_len else ""
    return f"min(max_model_len {config.max_model_len}, max_position_embeddings {int(positions)}){capped}"


def check_request(
    config: EngineConfig,
    model_config: Any,
    used_ids: set[str],
    prompt_token_ids: list[int],
    params: SamplingParams,
    request_id: str,
    num_scored_tokens: int = 0,
) -> None:
    """Raise PromptError for a request the engine would refuse: a reused id, too long, or a bad prompt."""
    if request_id in used_ids:
        raise PromptError(f"request id {request_id!r} is already in use")
    limit = max_model_len(config, model_config)
    if prompt_token_ids and len(prompt_token_ids) + params.max_new_tokens > limit:
        raise PromptError(
            f"request {request_id!r}: prompt ({len(prompt_token_ids)} tokens) + max_new_tokens "
            f"({params.max_new_tokens}) exceeds the model length limit {limit} = "
            f"{length_limit_reason(config, model_config)}"
        )
    check_prompt(request_id, prompt_token_ids, params, limit, int(model_config.vocab_size), num_scored_tokens)


def new_sequence(
    prompt_token_ids: list[int],
    params: SamplingParams,
    request_id: str,
    request_class: str,
    num_scored_tokens: int,
    is_logits_kept: bool,
    arrival_s: float | None,
    modeled_clock_s: float,
    seed: int,
) -> Sequence:
    """The sequence an accepted request becomes: arrival times set, its own sampling generator seeded."""
    seq = Sequence(request_id, list(prompt_token_ids), params, request_class, is_logits_kept=is_logits_kept)
    seq.num_scored_tokens = num_scored_tokens
    if arrival_s is not None:
        seq.arrival_s = arrival_s
    seq.modeled_arrival_s = modeled_clock_s
    seq.generator = torch.Generator().manual_seed(seed)
    return seq

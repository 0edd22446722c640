"""Choosing the next token: greedy, or seeded temperature / nucleus sampling."""

from __future__ import annotations

import torch

from fallbackgate.engine.sequence import SamplingParams, TokenLogprobs


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token from fp32 `logits` [vocab]: argmax at temperature 0, else a draw from `generator`."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        drop = torch.cumsum(sorted_probs, 0) - sorted_probs > params.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def top_logprobs(logits: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """The log-probability of `token` and the `k` most probable tokens under fp32 `logits` [vocab] (the model's
    distribution, before temperature)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(logp, min(k, logp.shape[-1]))
    return TokenLogprobs(token, float(logp[token]), tuple(ids.tolist()), tuple(values.tolist()))


def rows_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
    """:func:`top_logprobs` of each row of fp32 `logits` [n, vocab] for its target, in one log-softmax (as
    teacher-forced scoring computes them)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(1, torch.tensor(targets, dtype=torch.long, device=logp.device)[:, None])[:, 0].tolist()
    values, ids = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
    return [
        TokenLogprobs(t, p, tuple(i), tuple(v))
        for t, p, i, v in zip(targets, picked, ids.tolist(), values.tolist(), strict=True)
    ]

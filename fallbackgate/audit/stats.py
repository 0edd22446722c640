"""Diff statistics against the exact baseline, defined as llama.cpp's ``--kl-divergence`` and vLLM's
``check_logprobs_close`` define them.

Per generated position i, from exact logits ``E[i]`` and engine logits ``Q[i]`` (both ``[V]``) and the
emitted token ``t_i`` (teacher-forced: the exact logits are computed on the tokens the engine emitted):

- ``kl``: KL(exact ‖ engine) = Σ_v p_E(v) (log p_E(v) − log p_Q(v)) in nats, log-softmax in float64;
- ``top1_agree``: argmax E == argmax Q (llama.cpp's "Same top p");
- ``delta_p``: p_Q(t_i) − p_E(t_i) (llama.cpp's Δp, engine minus base);
- ``max_abs_dlogit``: max_v |Q[v] − E[v]|;
- ``vllm_top5_ok``: each side's argmax token is in the other side's top 5 (vLLM's check, applied at
  every position since both sides are teacher-forced on the same tokens);
- ``exact_top2_gap``: E's top-1 logit minus its top-2 logit; a top-1 disagreement where this gap is
  within the exact-vs-exact control's logit noise is a near-tie that rounding alone can flip.

``top1_outside_ties`` (per request, given a tie margin): the fraction of positions that agree or whose
exact top-2 gap is within the margin.

Per request (llama.cpp's summary): mean, median, p99 (linear interpolation between order
statistics) and max KL; ``sem_kl`` = sqrt((mean(kl²) − mean(kl)²)/(n − 1)), llama.cpp's "±" of the
mean KLD; top-1 agreement rate; RMS Δp = sqrt(mean(Δp²)); ``ppl_ratio`` = PPL(engine)/PPL(exact) =
exp(mean NLL_engine − mean NLL_exact) over the emitted tokens; ``first_divergence`` = first position
with a top-1 disagreement, or None.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

TOP_K_VLLM = 5


@dataclasses.dataclass(frozen=True, slots=True)
class PositionDiff:
    """Diff statistics of one generated position (field names match the ledger's columns)."""

    position: int  # index of the output token (0 = first generated token)
    token_id: int  # emitted token
    kl: float  # KL(exact ‖ engine), nats
    top1_agree: bool  # argmax exact == argmax engine
    delta_p: float  # p_engine(token) - p_exact(token)
    max_abs_dlogit: float  # max over the vocabulary of |logit_engine - logit_exact|
    vllm_top5_ok: bool  # each side's argmax in the other's top-5
    logp_exact: float  # log p_exact(token)
    logp_engine: float  # log p_engine(token)
    exact_top2_gap: float | None = None  # exact top-1 minus top-2 logit (None: unknown, or a one-entry vocabulary)
    replay_kl: float | None = None  # KL(replay ‖ engine) at this position (None: not replayed)


@dataclasses.dataclass(frozen=True, slots=True)
class RequestDiffStats:
    """Per-request summary of :class:`PositionDiff` rows (field names match ``request_stats``)."""

    num_positions: int
    mean_kl: float
    median_kl: float
    p99_kl: float
    max_kl: float
    sem_kl: float  # standard error of mean_kl
    top1_agreement: float  # fraction of positions with top1_agree
    rms_delta_p: float
    ppl_ratio: float  # PPL(engine) / PPL(exact) over the emitted tokens
    first_divergence: int | None  # first position with a top-1 disagreement


def position_diffs(
    exact_logits: torch.Tensor,
    engine_logits: torch.Tensor,
    token_ids: torch.Tensor | list[int],
    first_position: int = 0,
) -> list[PositionDiff]:
    """Per-position diff statistics from ``[N, V]`` exact and engine logits and ``[N]`` emitted tokens (the
    first row at output position ``first_position``)."""
    exact = exact_logits.detach().to("cpu", torch.float64)
    engine = engine_logits.detach().to("cpu", torch.float64)
    if exact.shape != engine.shape or exact.dim() != 2:
        raise ValueError(f"logits must both be [N, V]; got {tuple(exact.shape)} and {tuple(engine.shape)}")
    tokens = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
    if tokens.numel() != exact.shape[0]:
        raise ValueError(f"{tokens.numel()} token ids for {exact.shape[0]} positions")
    k = min(TOP_K_VLLM, exact.shape[1])
    logp_e = torch.log_softmax(exact, dim=-1)
    logp_q = torch.log_softmax(engine, dim=-1)
    kl = (logp_e.exp() * (logp_e - logp_q)).sum(dim=-1)
    top_e, top_q = exact.argmax(dim=-1), engine.argmax(dim=-1)
    topk_e, topk_q = exact.topk(k, dim=-1).indices, engine.topk(k, dim=-1).indices
    e_in_q = (topk_q == top_e[:, None]).any(dim=-1)
    q_in_e = (topk_e == top_q[:, None]).any(dim=-1)
    lp_e = logp_e.gather(1, tokens[:, None]).squeeze(1)
    lp_q = logp_q.gather(1, tokens[:, None]).squeeze(1)
    dp = lp_q.exp() - lp_e.exp()
    dlogit = (engine - exact).abs().amax(dim=-1)
    top2 = exact.topk(min(2, exact.shape[1]), dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1]).tolist() if top2.shape[1] > 1 else [None] * top2.shape[0]
    return [
        PositionDiff(
            position=first_position + i,
            token_id=int(tokens[i]),
            kl=float(kl[i]),
            top1_agree=bool(top_e[i] == top_q[i]),
            delta_p=float(dp[i]),
            max_abs_dlogit=float(dlogit[i]),
            vllm_top5_ok=bool(e_in_q[i] and q_in_e[i]),
            logp_exact=float(lp_e[i]),
            logp_engine=float(lp_q[i]),
            exact_top2_gap=gaps[i],
        )
        for i in range(tokens.numel())
    ]


def percentile(sorted_values: list[float], fraction: float) -> float:
    """llama.cpp's percentile: linear interpolation between neighbouring order statistics."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    if fraction <= 0:
        return sorted_values[0]
    if fraction >= 1:
        return sorted_values[-1]
    p = fraction * (len(sorted_values) - 1)
    ip = int(p)
    p -= ip
    return (1 - p) * sorted_values[ip] + p * sorted_values[min(ip + 1, len(sorted_values) - 1)]


def request_stats(diffs: list[PositionDiff]) -> RequestDiffStats:
    """Summary statistics of one request's position diffs (see the module docstring)."""
    n = len(diffs)
    if n == 0:
        raise ValueError("no positions to summarise")
    kls = [d.kl for d in diffs]
    mean = math.fsum(kls) / n
    var = math.fsum(k * k for k in kls) / n - mean * mean
    sem = math.sqrt(max(var, 0.0) / (n - 1)) if n > 1 else 0.0
    ordered = sorted(kls)
    median = percentile(ordered, 0.5)
    nll_gap = math.fsum(d.logp_exact - d.logp_engine for d in diffs) / n
    first = next((d.position for d in diffs if not d.top1_agree), None)
    return RequestDiffStats(
        num_positions=n,
        mean_kl=mean,
        median_kl=median,
        p99_kl=percentile(ordered, 0.99),
        max_kl=ordered[-1],
        sem_kl=sem,
        top1_agreement=sum(d.top1_agree for d in diffs) / n,
        rms_delta_p=math.sqrt(math.fsum(d.delta_p**2 for d in diffs) / n),
        ppl_ratio=math.exp(nll_gap),
        first_divergence=first,
    )


def top1_outside_ties(diffs: list[Any], tie_margin: float) -> float:
    """Top-1 agreement counting a disagreement only where the exact top-2 gap exceeds `tie_margin` logits
    (`diffs`: PositionDiff objects or ledger rows with ``top1_agree`` and ``exact_top2_gap``)."""
    if not diffs:
        raise ValueError("no positions to summarise")

    def field(d: Any, name: str) -> Any:
        return d[name] if isinstance(d, dict) else getattr(d, name)

    def counts(d: Any) -> bool:
        gap = field(d, "exact_top2_gap")
        return bool(field(d, "top1_agree")) or (gap is not None and gap <= tie_margin)

    return sum(counts(d) for d in diffs) / len(diffs)


def audit(
    exact_logits: torch.Tensor,
    engine_logits: torch.Tensor,
    token_ids: torch.Tensor | list[int],
) -> tuple[list[PositionDiff], RequestDiffStats]:
    """Position diffs and their summary in one call (what the ledger writer's record_diffs takes)."""
    diffs = position_diffs(exact_logits, engine_logits, token_ids)
    return diffs, request_stats(diffs)

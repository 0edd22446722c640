"""The auditor: exact baseline for finished requests, diff statistics, the numeric-floor control."""

from __future__ import annotations

import random

import torch

from fallbackgate.audit.stats import PositionDiff, RequestDiffStats, audit
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.messages import RequestOutput


def exact_rows(engine: Engine, output: RequestOutput, num_chunked: int = 0) -> torch.Tensor:
    """Exact logits at every generated position: one teacher-forced pass over prompt + output."""
    tokens = output.prompt_token_ids + output.output_token_ids[:-1]
    logits = engine.exact_logits(tokens, num_chunked)
    return logits[len(output.prompt_token_ids) - 1 :]


def audit_output(engine: Engine, output: RequestOutput) -> tuple[list[PositionDiff], RequestDiffStats]:
    """Diffs of one request's engine logits against its exact baseline."""
    return audit(exact_rows(engine, output), output.output_logits, output.output_token_ids)


def numeric_floor(engine: Engine, output: RequestOutput) -> float:
    """Max KL between two exact computations of the same request (one prefill vs token by token)."""
    one_pass = exact_rows(engine, output)
    chunked = exact_rows(engine, output, num_chunked=len(output.output_token_ids) - 1)
    _, stats = audit(one_pass, chunked, output.output_token_ids)
    return stats.max_kl


def choose_audited(outputs: list[RequestOutput], sample_rate: float, seed: int) -> list[RequestOutput]:
    """The requests to audit: all at rate 1, else a seeded sample (at least one)."""
    if sample_rate >= 1.0:
        return list(outputs)
    rng = random.Random(seed)
    chosen = [o for o in outputs if rng.random() < sample_rate]
    return chosen or outputs[:1]

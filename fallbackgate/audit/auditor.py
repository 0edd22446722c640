"""The auditor: exact baseline for finished requests, diff statistics, the numeric-floor control."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import torch

from fallbackgate.audit.replay import replay_logits
from fallbackgate.audit.replay_trace import TraceError, load_trace
from fallbackgate.audit.stats import PositionDiff, RequestDiffStats, audit, percentile
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.messages import RequestOutput
from fallbackgate.ledger.db import Ledger


def exact_rows(engine: Engine, output: RequestOutput, num_chunked: int = 0) -> torch.Tensor:
    """Exact logits at every generated position: one teacher-forced pass over prompt + output."""
    tokens = output.prompt_token_ids + output.output_token_ids[:-1]
    logits = engine.exact_logits(tokens, num_chunked)
    return logits[len(output.prompt_token_ids) - 1 :]


def audit_output(engine: Engine, output: RequestOutput) -> tuple[list[PositionDiff], RequestDiffStats]:
    """Diffs of one request's engine logits against its exact baseline."""
    return audit(exact_rows(engine, output), output.output_logits, output.output_token_ids)


def replay_diffs(
    engine: Engine, ledger: Ledger, run_id: int, output: RequestOutput
) -> tuple[list[float] | None, dict[str, Any]]:
    """Served logits against the replay of the request's ledger trace: KL(replay ‖ served) per output
    position, and ``max_kl``, ``mean_kl``, ``max_position``, ``top1_agreement``. A trace the replay cannot
    follow (rows missing, or contradicting the served tokens) gives no positions, an infinite ``max_kl``
    and the ``error``."""
    try:
        replayed = replay_logits(engine, load_trace(ledger, run_id, output.request_id))
    except TraceError as exc:
        inf = float("inf")
        return None, {"max_kl": inf, "mean_kl": inf, "max_position": None, "top1_agreement": 0.0, "error": str(exc)}
    diffs, stats = audit(replayed, output.output_logits, output.output_token_ids)
    worst = max(diffs, key=lambda d: d.kl)
    summary = {
        "max_kl": stats.max_kl,
        "mean_kl": stats.mean_kl,
        "max_position": worst.position,
        "top1_agreement": stats.top1_agreement,
    }
    return [d.kl for d in diffs], summary


def audit_with_replay(
    engine: Engine, ledger: Ledger, run_id: int, output: RequestOutput
) -> tuple[list[PositionDiff], RequestDiffStats, dict[str, Any]]:
    """Both baselines for one request: diffs against the exact baseline carrying each position's replay KL,
    their summary, and the replay's summary (see :func:`replay_diffs`)."""
    diffs, stats = audit_output(engine, output)
    replay_kls, replay = replay_diffs(engine, ledger, run_id, output)
    if replay_kls is not None:
        diffs = [dataclasses.replace(d, replay_kl=k) for d, k in zip(diffs, replay_kls, strict=True)]
    return diffs, stats, replay


def control_diffs(engine: Engine, output: RequestOutput) -> tuple[list[PositionDiff], RequestDiffStats]:
    """Diffs between two exact computations of the same request (one prefill vs token by token)."""
    one_pass = exact_rows(engine, output)
    chunked = exact_rows(engine, output, num_chunked=len(output.output_token_ids) - 1)
    return audit(one_pass, chunked, output.output_token_ids)


def numeric_floor(engine: Engine, output: RequestOutput) -> float:
    """Max KL between two exact computations of the same request (one prefill vs token by token)."""
    return control_diffs(engine, output)[1].max_kl


NUM_FLOOR_REQUESTS = 3  # requests the exact-vs-exact control runs on (the largest of each statistic counts)


def floor_control(engine: Engine, outputs: list[RequestOutput]) -> dict[str, Any]:
    """The exact-vs-exact control on up to NUM_FLOOR_REQUESTS requests, in the engine's dtype: one prefill
    pass against token-by-token decoding of the same tokens. Returns the worst of each statistic
    (``max_kl``, ``mean_kl``, ``p99_kl``, ``max_abs_dlogit``, lowest ``top1_agreement``), the distribution
    of per-position KL pooled over all its requests and positions (``position_kl``: p50, p99, max), how many
    requests it ran on and the ``dtype``: what exact computation itself differs by, which the gate's
    tolerances and budgets are measured against."""
    worst: dict[str, Any] = {"max_kl": 0.0, "mean_kl": 0.0, "p99_kl": 0.0, "max_abs_dlogit": 0.0, "top1_agreement": 1.0}
    chosen = outputs[:NUM_FLOOR_REQUESTS]
    pooled: list[float] = []
    for output in chosen:
        diffs, stats = control_diffs(engine, output)
        pooled += [d.kl for d in diffs]
        for key in ("max_kl", "mean_kl", "p99_kl"):
            worst[key] = max(worst[key], getattr(stats, key))
        worst["max_abs_dlogit"] = max([worst["max_abs_dlogit"], *(d.max_abs_dlogit for d in diffs)])
        worst["top1_agreement"] = min(worst["top1_agreement"], stats.top1_agreement)
    worst["num_requests"] = len(chosen)
    worst["dtype"] = engine.dtype_name
    worst["position_kl"] = kl_distribution(pooled)
    return worst


def kl_distribution(kls: list[float]) -> dict[str, float | int]:
    """p50, p99 and max of per-position KLs pooled over requests, and how many positions they cover."""
    if not kls:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0, "num_positions": 0}
    ordered = sorted(kls)
    return {
        "p50": percentile(ordered, 0.5),
        "p99": percentile(ordered, 0.99),
        "max": ordered[-1],
        "num_positions": len(ordered),
    }


def choose_audited(outputs: list[RequestOutput], sample_rate: float, seed: int) -> list[RequestOutput]:
    """The requests to audit: all at rate 1, else a seeded sample (at least one)."""
    if sample_rate >= 1.0:
        return list(outputs)
    rng = random.Random(seed)
    chosen = [o for o in outputs if rng.random() < sample_rate]
    return chosen or outputs[:1]

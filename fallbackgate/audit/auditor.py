"""The auditor: exact baseline for finished requests, diff statistics, the numeric-floor control."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any

import torch

from fallbackgate.audit.baseline import Baseline
from fallbackgate.audit.replay import Replayer
from fallbackgate.audit.replay_trace import TraceError, load_trace
from fallbackgate.audit.stats import PositionDiff, RequestDiffStats, percentile, position_diffs, request_stats
from fallbackgate.engine.baseline.api import BaselineEngine
from fallbackgate.engine.messages import RequestOutput
from fallbackgate.ledger.db import Ledger

AUDIT_CHUNK = 32  # output positions whose full-vocabulary logits the audit holds at once
ServedRows = Callable[[int, int], torch.Tensor]  # (start, stop) -> served logits of those output positions


def in_memory(output: RequestOutput) -> ServedRows:
    """Served rows from a finished request still in memory."""
    return lambda start, stop: output.output_logits[start:stop]


def exact_diffs(
    output_ids: list[int], baseline: ServedRows, served: ServedRows, chunk: int = AUDIT_CHUNK
) -> list[PositionDiff]:
    """Per-position diffs of served logits against the exact baseline, `chunk` positions at a time."""
    diffs: list[PositionDiff] = []
    for start in range(0, len(output_ids), chunk):
        stop = min(start + chunk, len(output_ids))
        diffs += position_diffs(baseline(start, stop), served(start, stop), output_ids[start:stop], start)
    return diffs


def audit_output(engine: BaselineEngine, output: RequestOutput) -> tuple[list[PositionDiff], RequestDiffStats]:
    """Diffs of one request's engine logits against its exact baseline."""
    baseline = Baseline(engine, [(output.prompt_token_ids, output.output_token_ids)]).of(0)
    diffs = exact_diffs(output.output_token_ids, baseline, in_memory(output))
    return diffs, request_stats(diffs)


def replay_diffs(
    engine: BaselineEngine, ledger: Ledger, run_id: int, request_id: str, served: ServedRows, chunk: int = AUDIT_CHUNK
) -> tuple[list[float] | None, dict[str, Any]]:
    """Served logits against the replay of the request's ledger trace, streamed: KL(replay ‖ served) per
    output position, and ``max_kl``, ``mean_kl``, ``max_position``, ``top1_agreement``, ``routing_swaps``
    (tokens the replay routed as served across a router near-tie, ``routing_ties``). A trace the replay
    cannot follow (rows missing, or contradicting the served tokens) gives no positions, an infinite
    ``max_kl`` and the ``error``."""
    diffs: list[PositionDiff] = []
    try:
        trace = load_trace(ledger, run_id, request_id)
        output_ids = trace.token_ids[trace.num_prompt_tokens :]
        replayer = Replayer(engine, trace)
        for replayed in replayer.run(chunk):
            start, stop = len(diffs), len(diffs) + replayed.shape[0]
            diffs += position_diffs(replayed, served(start, stop), output_ids[start:stop], first_position=start)
    except TraceError as exc:
        inf = float("inf")
        return None, {"max_kl": inf, "mean_kl": inf, "max_position": None, "top1_agreement": 0.0, "error": str(exc)}
    stats = request_stats(diffs)
    worst = max(diffs, key=lambda d: d.kl)
    summary = {
        "max_kl": stats.max_kl,
        "mean_kl": stats.mean_kl,
        "max_position": worst.position,
        "top1_agreement": stats.top1_agreement,
        "routing_swaps": replayer.num_routing_swaps,
    }
    return [d.kl for d in diffs], summary


def audit_request(
    engine: BaselineEngine,
    ledger: Ledger,
    run_id: int,
    request_id: str,
    prompt_ids: list[int],
    output_ids: list[int],
    served: ServedRows,
    is_replayed: bool = True,
    baseline: ServedRows | None = None,
) -> tuple[list[PositionDiff], RequestDiffStats, dict[str, Any] | None]:
    """Both baselines for one recorded request whose served logits `served` yields (from memory, or from
    the ledger for an audit worker); the replay only when `is_replayed` (None in its place otherwise).
    `baseline`: the request's rows of a batched exact baseline (default: a pass of its own)."""
    baseline = baseline or Baseline(engine, [(prompt_ids, output_ids)]).of(0)
    diffs = exact_diffs(output_ids, baseline, served)
    stats = request_stats(diffs)
    if not is_replayed:
        return diffs, stats, None
    replay_kls, replay = replay_diffs(engine, ledger, run_id, request_id, served)
    if replay_kls is not None:
        diffs = [dataclasses.replace(d, replay_kl=k) for d, k in zip(diffs, replay_kls, strict=True)]
    return diffs, stats, replay


def control_diffs(
    engine: BaselineEngine,
    prompt_ids: list[int],
    output_ids: list[int],
    baseline: ServedRows | None = None,
    max_positions: int | None = None,
) -> tuple[list[PositionDiff], RequestDiffStats]:
    """Diffs between two exact computations of the same tokens: the baseline's `baseline` rows (default: a
    batched pass of its own) against token-by-token decoding; the first `max_positions` output positions
    only, when given."""
    num = len(output_ids) if max_positions is None else min(max_positions, len(output_ids))
    baseline = baseline or Baseline(engine, [(prompt_ids, output_ids)]).of(0)
    tokens = list(prompt_ids) + list(output_ids[: num - 1])
    stepwise = engine.exact_chunks(tokens, len(prompt_ids) - 1, 1)
    diffs: list[PositionDiff] = []
    for start in range(0, num, AUDIT_CHUNK):
        stop = min(start + AUDIT_CHUNK, num)
        decoded = torch.cat([next(stepwise) for _ in range(stop - start)])
        diffs += position_diffs(baseline(start, stop), decoded, output_ids[start:stop], start)
    return diffs, request_stats(diffs)


def numeric_floor(engine: BaselineEngine, output: RequestOutput) -> float:
    """Max KL between two exact computations of the same request (see :func:`control_diffs`)."""
    return control_diffs(engine, output.prompt_token_ids, output.output_token_ids)[1].max_kl


NUM_FLOOR_REQUESTS = 3  # requests the exact-vs-exact control runs on up front (the largest of each statistic counts)


class FloorControl:
    """The exact-vs-exact control's statistics, accumulated over the requests it ran on."""

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype
        self.worst: dict[str, Any] = {
            "max_kl": 0.0,
            "mean_kl": 0.0,
            "p99_kl": 0.0,
            "max_abs_dlogit": 0.0,
            "top1_agreement": 1.0,
        }
        self.pooled: list[float] = []
        self.request_ids: list[str] = []

    def add(self, request_id: str, diffs: list[PositionDiff], stats: RequestDiffStats) -> None:
        """Fold one request's control diffs in."""
        self.request_ids.append(request_id)
        self.pooled += [d.kl for d in diffs]
        for key in ("max_kl", "mean_kl", "p99_kl"):
            self.worst[key] = max(self.worst[key], getattr(stats, key))
        self.worst["max_abs_dlogit"] = max([self.worst["max_abs_dlogit"], *(d.max_abs_dlogit for d in diffs)])
        self.worst["top1_agreement"] = min(self.worst["top1_agreement"], stats.top1_agreement)

    def summary(self) -> dict[str, Any]:
        """The worst of each statistic, the pooled per-position distribution, the requests and dtype."""
        return {
            **self.worst,
            "num_requests": len(self.request_ids),
            "request_ids": list(self.request_ids),
            "dtype": self.dtype,
            "position_kl": kl_distribution(self.pooled),
        }


def floor_control(
    engine: BaselineEngine, outputs: list[RequestOutput], max_positions: int | None = None
) -> dict[str, Any]:
    """The exact-vs-exact control on up to NUM_FLOOR_REQUESTS requests, in the engine's dtype: the
    baseline's own passes against token-by-token decoding of the same tokens (:func:`control_diffs`).
    Returns the worst of each statistic (``max_kl``, ``mean_kl``, ``p99_kl``, ``max_abs_dlogit``, lowest
    ``top1_agreement``), the distribution of per-position KL pooled over all its requests and positions
    (``position_kl``: p50, p99, max), which requests it ran on and the ``dtype``: what exact computation
    itself differs by, which the gate's tolerances and budgets are measured against."""
    control = FloorControl(engine.dtype_name)
    for output in outputs[:NUM_FLOOR_REQUESTS]:
        ids = (output.prompt_token_ids, output.output_token_ids)
        diffs, stats = control_diffs(engine, *ids, max_positions=max_positions)
        control.add(output.request_id, diffs, stats)
    return control.summary()


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


class AuditSampler:
    """Seeded audit draws, one per request, for streams whose requests are not known up front (a server, an
    lm-eval run); batches choose theirs up front with :func:`audited_ids`."""

    def __init__(self, sample_rate: float, seed: int) -> None:
        self.sample_rate = sample_rate
        self._rng = random.Random(seed)

    def draw(self) -> bool:
        """Whether the next request is audited (probability `sample_rate`)."""
        return self._rng.random() < self.sample_rate


def audited_ids(request_ids: list[str], sample_rate: float, seed: int) -> set[str]:
    """The ids of the requests to audit, chosen before they are served (so only these keep full logits): all at
    rate 1, else a seeded sample in submission order (at least the first)."""
    if sample_rate >= 1.0:
        return set(request_ids)
    rng = random.Random(seed)
    chosen = {rid for rid in request_ids if rng.random() < sample_rate}
    return chosen or set(request_ids[:1])


def choose_audited(outputs: list[RequestOutput], sample_rate: float, seed: int) -> list[RequestOutput]:
    """The requests to audit, in order: those :func:`audited_ids` chose."""
    chosen = audited_ids([o.request_id for o in outputs], sample_rate, seed)
    return [o for o in outputs if o.request_id in chosen]

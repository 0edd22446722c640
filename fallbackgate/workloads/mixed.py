"""The mixed, phase-changing workload: bursts of one kind, then of another.

Phases cycle through the probe's four kinds in a seeded order (every kind once per round, no kind twice in a
row); each phase is a burst of its kind at a multiple of that kind's own rate, and an idle gap separates two
phases. Requests are split evenly over the phases.
"""

from __future__ import annotations

import dataclasses
import random

from fallbackgate.workloads.arrivals import idle_gap_s
from fallbackgate.workloads.kinds import Context, Request, WorkloadKind, kind_entry, register_kind

PHASE_KINDS = (
    WorkloadKind.SHORT_CHAT,
    WorkloadKind.LONG_RETRIEVAL,
    WorkloadKind.MULTI_TURN,
    WorkloadKind.LONG_REASONING,
)


BURST_FACTOR = 4.0  # a phase's arrival rate against its kind's own default
MEAN_GAP_S = 5.0  # idle time between two phases (exponential)


def phase_kinds(rng: random.Random, num_phases: int) -> list[WorkloadKind]:
    """The kind of each phase: rounds of the four kinds in seeded orders, never the same kind twice in a row."""
    order: list[WorkloadKind] = []
    while len(order) < num_phases:
        round_ = rng.sample(PHASE_KINDS, len(PHASE_KINDS))
        if order and round_[0] == order[-1]:
            round_ = round_[1:] + round_[:1]
        order += round_
    return order[:num_phases]


@register_kind(WorkloadKind.MIXED, 0.0, "phases of the other four kinds in bursts, one kind after another")
def mixed(ctx: Context, rng: random.Random, count: int, rate_per_s: float, start_s: float) -> list[Request]:
    """`count` requests in `ctx.num_phases` phases (at least one request each); `rate_per_s` > 0 sets every
    burst's rate, else each is `BURST_FACTOR` times its kind's default."""
    if ctx.num_phases < 2 or count < ctx.num_phases:
        raise ValueError(f"{count} requests cannot fill {ctx.num_phases} phases (at least 2, one request each)")
    requests: list[Request] = []
    next_session, phase_start = 0, start_s
    for index, kind in enumerate(phase_kinds(rng, ctx.num_phases)):
        entry = kind_entry(kind)
        size = count // ctx.num_phases + (1 if index < count % ctx.num_phases else 0)
        burst = entry.generate(ctx, rng, size, rate_per_s or entry.rate_per_s * BURST_FACTOR, phase_start)
        sessions = [r.session for r in burst if r.session is not None]
        requests += [
            dataclasses.replace(r, session=r.session + next_session) if r.session is not None else r for r in burst
        ]
        next_session += max(sessions) + 1 if sessions else 0
        phase_start = max(r.arrival_s for r in burst) + idle_gap_s(rng, MEAN_GAP_S)
    return requests

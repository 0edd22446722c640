"""Seeded arrival processes: Poisson arrivals, idle gaps between bursts, and multi-turn turns that arrive
after the previous turn's expected finish plus a think time."""

from __future__ import annotations

import dataclasses
import random


@dataclasses.dataclass(frozen=True, slots=True)
class TurnTiming:
    """When the next turn of a session comes: nominal service rates (not measured; a replay measures) plus
    an exponentially distributed think time (the tool call and the user)."""

    prefill_tokens_per_s: float = 2000.0
    decode_tokens_per_s: float = 20.0
    mean_think_s: float = 2.0

    def expected_service_s(self, prompt_tokens: int, max_new_tokens: int) -> float:
        """Seconds from a turn's arrival to its last token, at the nominal rates."""
        return prompt_tokens / self.prefill_tokens_per_s + max_new_tokens / self.decode_tokens_per_s


def poisson_arrivals(rng: random.Random, count: int, rate_per_s: float, start_s: float = 0.0) -> list[float]:
    """`count` arrival times of a Poisson process of `rate_per_s` starting at `start_s` (sorted)."""
    times, now = [], start_s
    for _ in range(count):
        now += rng.expovariate(rate_per_s)
        times.append(now)
    return times


def next_turn_arrival_s(
    rng: random.Random, arrival_s: float, prompt_tokens: int, max_new_tokens: int, timing: TurnTiming
) -> float:
    """The next turn's arrival: this turn's arrival + its expected service + a think time."""
    return (
        arrival_s
        + timing.expected_service_s(prompt_tokens, max_new_tokens)
        + rng.expovariate(1.0 / timing.mean_think_s)
    )


def idle_gap_s(rng: random.Random, mean_s: float) -> float:
    """An exponentially distributed idle time between two bursts."""
    return rng.expovariate(1.0 / mean_s)

"""A planted synthetic trace: known co-burst lift and lag, a best static split that flips between two phases,
a known router predictability, a known device and a known dual-miss crossover, all drawn from one seed.

What is planted, and what the analyses must recover (:class:`Planted` holds the parameters):

- recorded misses: in step t and layer l an expert miss (E) and a KV miss (K) are drawn jointly with
  P(E) = pe(1 + a s_t), P(K) = pk(1 + a s_{t-L}), P(E and K) = lift_in_cell P(E) P(K), where s is a ±1 Markov
  chain switching with probability q. Overall lift = lift_in_cell (1 + a² (1-2q)^L); the per-step miss series
  cross-correlate most at lag L (KV after experts).
- the access sequence (which experts and KV blocks, independent of the recorded misses): phase A cycles
  through an expert working set of 3/4 of :attr:`Planted.total_budget_bytes` and a KV working set of 1/4; phase B
  the reverse. An LRU of each kind therefore hits everything exactly at expert share 3/4 in phase A and 1/4
  in phase B, and misses every access of a kind whose share is smaller: one flip.
- routing: a token's picks at layer l+1 are its picks at layer l with probability 1 - route_noise, else
  random experts of the working set.
- I/O: every recorded miss is one read taking latency + bytes / bandwidth; a step lasts compute_ns plus its
  waits.
- arbitration: dual misses price expert-first at latency + expert bytes / bandwidth and recompute at
  recompute_ns_per_token × context tokens (per phase), so the cheaper exact option flips at a known context.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from fallbackgate.tracing.schema import TraceTable
from fallbackgate.tracing.writer import TraceWriter

MIB = 1 << 20


@dataclasses.dataclass(slots=True, frozen=True)
class Planted:
    """The planted parameters of a synthetic trace."""

    seed: int = 0
    num_steps_per_phase: int = 500  # decode steps in each of the two phases
    num_layers: int = 8
    num_experts: int = 16  # experts per layer
    top_k: int = 2
    num_requests_per_phase: int = 2  # the batch (one set of requests per phase)
    bytes_per_expert: int = 8 * MIB
    bytes_per_kv_block: int = 2 * MIB
    total_budget_bytes: int = 1024 * MIB  # expert + KV device memory the split divides
    expert_share_a: float = 0.75  # phase A's exact-fit expert share of the budget
    expert_share_b: float = 0.25  # phase B's
    expert_miss_rate: float = 0.15  # pe
    kv_miss_rate: float = 0.10  # pk
    lift_in_cell: float = 1.5  # P(E and K) / (P(E) P(K)) at fixed burst state
    burst_amplitude: float = 0.8  # a
    burst_switch_prob: float = 0.2  # q
    kv_lag_steps: int = 3  # L
    route_noise: float = 0.2  # share of tokens whose next-layer picks are random
    latency_ns: int = 100_000  # the planted device: per-read latency
    bandwidth_bytes_per_s: float = 2e9  # and bandwidth
    compute_ns: int = 5_000_000  # each step's compute
    slo_tpot_ns: int = 20_000_000
    recompute_ns_per_token: tuple[int, int] = (1_000, 4_000)  # (prefill, decode) recompute cost per context token
    num_decisions: int = 2000

    @property
    def expected_lift(self) -> float:
        """The overall same-cell lift the analyses must find."""
        rho = (1 - 2 * self.burst_switch_prob) ** self.kv_lag_steps
        return self.lift_in_cell * (1 + self.burst_amplitude**2 * rho)

    def read_ns(self, num_bytes: int | np.ndarray) -> Any:
        """The planted device's time for one read."""
        return self.latency_ns + np.asarray(num_bytes) * 1e9 / self.bandwidth_bytes_per_s

    def working_sets(self, phase: int) -> tuple[int, int]:
        """(experts per layer, KV blocks per request per layer) that exactly fill the phase's split."""
        share = (self.expert_share_a, self.expert_share_b)[phase]
        experts = round(share * self.total_budget_bytes / self.bytes_per_expert / self.num_layers)
        kv_bytes = (1 - share) * self.total_budget_bytes
        blocks = round(kv_bytes / self.bytes_per_kv_block / self.num_layers / self.num_requests_per_phase)
        return experts, blocks

    def expected_router_precision(self) -> float:
        """Precision of a predictor that repeats a token's layer-l picks at layer l+1 (averaged over phases)."""
        chance = np.mean([self.top_k / self.working_sets(p)[0] for p in (0, 1)])
        return (1 - self.route_noise) + self.route_noise * float(chance)

    def crossover_tokens(self, phase: int) -> float:
        """Context length above which expert-first beats recompute on the planted device."""
        return float(self.read_ns(self.bytes_per_kv_block)) / self.recompute_ns_per_token[phase]


def _burst(rng: np.random.Generator, planted: Planted, num_steps: int) -> np.ndarray:
    flips = rng.random(num_steps + planted.kv_lag_steps) < planted.burst_switch_prob
    start = 1 if rng.random() < 0.5 else -1
    return start * np.where(np.cumsum(flips) % 2 == 0, 1, -1)


def _misses(rng: np.random.Generator, planted: Planted, num_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """[steps, layers] booleans: expert miss, KV miss per cell."""
    s = _burst(rng, planted, num_steps)
    lag = planted.kv_lag_steps
    pe = planted.expert_miss_rate * (1 + planted.burst_amplitude * s[lag:])[:, None]
    pk = planted.kv_miss_rate * (1 + planted.burst_amplitude * s[:num_steps])[:, None]
    p11 = planted.lift_in_cell * pe * pk
    u = rng.random((num_steps, planted.num_layers))
    both = u < p11
    expert_only = (u >= p11) & (u < pe)
    kv_only = (u >= pe) & (u < pe + pk - p11)
    return both | expert_only, both | kv_only


def _routing(rng: np.random.Generator, planted: Planted, phase: int, num_steps: int) -> np.ndarray:
    """[steps, layers, requests, k] expert ids: cyclic at layer 0, copied (or random) layer to layer."""
    width, _ = planted.working_sets(phase)
    num_r, k = planted.num_requests_per_phase, planted.top_k
    slots = (np.arange(num_steps)[:, None] * num_r * k + np.arange(num_r * k)[None, :]) % width
    picks = np.empty((num_steps, planted.num_layers, num_r, k), dtype=np.int64)
    picks[:, 0] = slots.reshape(num_steps, num_r, k)
    for layer in range(1, planted.num_layers):
        noisy = rng.random((num_steps, num_r)) < planted.route_noise
        random_picks = np.argsort(rng.random((num_steps, num_r, width)), axis=2)[..., :k]
        picks[:, layer] = np.where(noisy[..., None], random_picks, picks[:, layer - 1])
    return picks


@dataclasses.dataclass(slots=True)
class _Phase:
    """One phase's generated rows, before they are written."""

    planted: Planted
    phase: int  # 0 = A, 1 = B
    first_step: int
    start_ns: int
    rng: np.random.Generator

    @property
    def request_ids(self) -> np.ndarray:
        return np.array([f"{'ab'[self.phase]}{r}" for r in range(self.planted.num_requests_per_phase)])


def _pick_one(rng: np.random.Generator, is_miss: np.ndarray, cell_size: int) -> np.ndarray:
    """Flat mask over [steps, layers, cell_size]: one random row of each missing cell."""
    chosen = rng.integers(0, cell_size, size=is_miss.shape)
    mask = np.zeros((*is_miss.shape, cell_size), dtype=bool)
    np.put_along_axis(mask, chosen[..., None], is_miss[..., None], axis=2)
    return mask.reshape(-1)


def _phase_rows(ph: _Phase, writer: TraceWriter) -> int:
    """Write one phase's steps, accesses, I/O and requests; returns the phase's end time (ns)."""
    p, rng, n = ph.planted, ph.rng, ph.planted.num_steps_per_phase
    num_r, k, num_l = p.num_requests_per_phase, p.top_k, p.num_layers
    _, num_blocks = p.working_sets(ph.phase)
    expert_miss, kv_miss = _misses(rng, p, n)
    picks = _routing(rng, p, ph.phase, n)  # [n, L, R, k]
    steps = ph.first_step + np.arange(n)
    e_shape, kv_shape = (n, num_l, num_r, k), (n, num_l, num_r, num_blocks)
    e_miss = _pick_one(rng, expert_miss, num_r * k)
    kv_miss_rows = _pick_one(rng, kv_miss, num_r * num_blocks)
    e_ns = np.where(e_miss, p.read_ns(p.bytes_per_expert) * rng.normal(1, 0.02, e_miss.size), 0).astype(np.int64)
    kv_ns = np.where(kv_miss_rows, p.read_ns(p.bytes_per_kv_block) * rng.normal(1, 0.02, kv_miss_rows.size), 0)
    kv_ns = kv_ns.astype(np.int64)
    wait = e_ns.reshape(n, -1).sum(1) + kv_ns.reshape(n, -1).sum(1)
    ends = ph.start_ns + np.cumsum(wait + p.compute_ns)
    starts = ends - wait - p.compute_ns
    writer.append(TraceTable.STEPS, step=steps, phase=np.full(n, 1), start_ns=starts, end_ns=ends,
                  batch=np.full(n, num_r), tokens=np.full(n, num_r))  # fmt: skip
    grid = np.indices(e_shape).reshape(4, -1)
    repeats = np.concatenate([np.zeros((n, 1, num_r, k), bool), picks[:, 1:] == picks[:, :-1]], axis=1)
    writer.append(
        TraceTable.EXPERT_ACCESS, step=steps[grid[0]], request=ph.request_ids[grid[2]], layer=grid[1],
        expert=picks.reshape(-1), router_rank=grid[3], router_weight=np.where(grid[3] == 0, 0.7, 0.3),
        tier_before=np.where(e_miss, 2, 0), tag=np.where(e_miss, 1, 0), bytes=e_miss * p.bytes_per_expert,
        ns=e_ns, is_predicted=repeats.reshape(-1),
    )  # fmt: skip
    kv = np.indices(kv_shape).reshape(4, -1)
    writer.append(
        TraceTable.KV_ACCESS, step=steps[kv[0]], request=ph.request_ids[kv[2]], layer=kv[1], block=kv[3],
        content_hash=(kv[2] + 97 * ph.phase) * 1_000_003 + kv[3], tier_before=np.where(kv_miss_rows, 2, 0),
        tag=np.where(kv_miss_rows, 1, 0), bytes=kv_miss_rows * p.bytes_per_kv_block, ns=kv_ns,
    )  # fmt: skip
    _io_rows(ph, writer, starts, (grid, e_miss, e_ns, picks.reshape(-1)), (kv, kv_miss_rows, kv_ns))
    first_token = starts[0] + (ends[0] - starts[0])
    writer.append(
        TraceTable.REQUESTS, request=ph.request_ids, request_class=np.full(num_r, "planted"),
        slo_ttft_ns=None, slo_tpot_ns=np.full(num_r, p.slo_tpot_ns), arrival_ns=np.full(num_r, ph.start_ns),
        first_token_ns=np.full(num_r, first_token), finish_ns=np.full(num_r, ends[-1]),
        prompt_tokens=np.full(num_r, num_blocks * 16), output_tokens=np.full(num_r, n),
    )  # fmt: skip
    return int(ends[-1])


def _io_rows(ph: _Phase, writer: TraceWriter, starts: np.ndarray, experts: tuple, kvs: tuple) -> None:
    """One read per recorded miss, issued one after another from the step's start."""
    p = ph.planted
    grid, e_miss, e_ns, expert_ids = experts
    kv, kv_miss, kv_ns = kvs
    e_step, kv_step = grid[0][e_miss], kv[0][kv_miss]
    step_local = np.concatenate([e_step, kv_step])
    durations = np.concatenate([e_ns[e_miss], kv_ns[kv_miss]])
    order = np.argsort(step_local, kind="stable")
    step_local, durations = step_local[order], durations[order]
    cumulative = np.cumsum(durations)
    first_of_step = np.searchsorted(step_local, step_local, side="left")
    before = cumulative - durations - np.where(first_of_step > 0, cumulative[first_of_step - 1], 0)
    submit = starts[step_local] + before
    e_objects = [f"{layer}:{e}" for layer, e in zip(grid[1][e_miss], expert_ids[e_miss], strict=True)]
    requests = ph.request_ids[kv[2][kv_miss]]
    kv_objects = [f"{r}:{layer}:{b}" for r, layer, b in zip(requests, kv[1][kv_miss], kv[3][kv_miss], strict=True)]
    offsets = np.concatenate([(grid[1][e_miss] * p.num_experts + expert_ids[e_miss]) * p.bytes_per_expert,
                              np.full(kv_miss.sum(), -1)])  # fmt: skip
    sizes = np.concatenate([np.full(e_miss.sum(), p.bytes_per_expert), np.full(kv_miss.sum(), p.bytes_per_kv_block)])
    kinds = np.concatenate([np.zeros(e_miss.sum(), int), np.ones(kv_miss.sum(), int)])
    writer.append(
        TraceTable.IO, step=ph.first_step + step_local, op=np.zeros(len(order), int), object_kind=kinds[order],
        object=np.array(e_objects + kv_objects)[order], tier=np.full(len(order), 2), bytes=sizes[order],
        offset=offsets[order], submit_ns=submit, start_ns=submit, end_ns=submit + durations,
        queue_depth=np.ones(len(order), int), requester=np.full(len(order), "demand"),
    )  # fmt: skip


def _arbitration(planted: Planted, rng: np.random.Generator, writer: TraceWriter) -> None:
    """Dual-miss decisions with every option priced on the planted device; the cheapest exact one chosen."""
    p, num = planted, planted.num_decisions
    phase = rng.integers(0, 2, num)  # 0 prefill, 1 decode
    context = rng.integers(16, 4096, num)
    read_e, read_kv = p.read_ns(p.bytes_per_expert), p.read_ns(p.bytes_per_kv_block)
    recompute = np.where(phase == 0, p.recompute_ns_per_token[0], p.recompute_ns_per_token[1]) * context
    # options (schema order of ArbitrationOption): expert_first, kv_first, lowbit, recompute, dequant, defer
    costs = np.stack([
        np.full(num, read_e + read_kv), np.full(num, read_kv + read_e + p.latency_ns),
        np.full(num, p.read_ns(p.bytes_per_expert // 4) + read_kv), read_e + recompute,
        np.full(num, read_e + p.read_ns(p.bytes_per_kv_block // 4)), np.zeros(num),
    ], axis=1).astype(np.int64)  # fmt: skip
    quality = np.array([0.0, 0.0, 0.01, 0.0, 0.01, 0.05])
    moved = np.array([p.bytes_per_expert + p.bytes_per_kv_block] * 2
                     + [p.bytes_per_expert // 4 + p.bytes_per_kv_block, p.bytes_per_expert,
                        p.bytes_per_expert + p.bytes_per_kv_block // 4, 0])  # fmt: skip
    exact = quality == 0
    chosen = np.argmin(np.where(exact, costs, np.iinfo(np.int64).max), axis=1)
    num_options = costs.shape[1]
    is_chosen = (np.arange(num_options)[None, :] == chosen[:, None]).reshape(-1)
    outcome = np.ma.masked_array(costs.reshape(-1) * rng.normal(1, 0.03, costs.size), mask=~is_chosen)
    total_steps = 2 * p.num_steps_per_phase
    steps = rng.integers(0, total_steps, num)
    requests = np.array([f"{'ab'[int(s >= p.num_steps_per_phase)]}{r}" for s, r in
                         zip(steps, rng.integers(0, p.num_requests_per_phase, num), strict=True)])  # fmt: skip
    rep = np.repeat
    writer.append(
        TraceTable.ARBITRATION, decision=rep(np.arange(num), num_options), step=rep(steps, num_options),
        request=rep(requests, num_options), layer=rep(rng.integers(0, p.num_layers, num), num_options),
        phase=rep(phase, num_options), context_tokens=rep(context, num_options),
        option=np.tile(np.arange(num_options), num), predicted_ns=costs.reshape(-1),
        predicted_quality_nats=np.tile(quality, num), bytes=np.tile(moved, num), is_chosen=is_chosen,
        outcome_ns=outcome.astype(np.int64),
    )  # fmt: skip


def write_planted_trace(directory: str | os.PathLike[str], planted: Planted | None = None) -> Planted:
    """Write the planted trace of ``planted`` (default parameters, seed 0) to ``directory``; returns them."""
    planted = planted or Planted()
    rng = np.random.default_rng(planted.seed)
    metadata = {
        "source": "synthetic",
        "workload": f"planted-seed{planted.seed}",
        "model": {
            "num_layers": planted.num_layers,
            "num_experts": planted.num_experts,
            "top_k": planted.top_k,
            "bytes_per_expert": planted.bytes_per_expert,
            "bytes_per_kv_block": planted.bytes_per_kv_block,
            "block_size": 16,
        },  # fmt: skip
        "budgets": {"expert_bytes": planted.total_budget_bytes // 2, "kv_bytes": planted.total_budget_bytes // 2},
        "controller": "planted",
        "profile": {
            "device": "planted-disk",
            "latency_ns": planted.latency_ns,
            "bandwidth_bytes_per_s": planted.bandwidth_bytes_per_s,
            "queue_depth": 1,
        },  # fmt: skip
        "planted": dataclasses.asdict(planted),
        "synthesized": ["all tables: a planted trace, not a recording"],
    }
    with TraceWriter(directory, metadata) as writer:
        start_ns = 0
        for phase in (0, 1):
            ph = _Phase(planted, phase, phase * planted.num_steps_per_phase, start_ns, rng)
            start_ns = _phase_rows(ph, writer)
        _arbitration(planted, rng, writer)
    return planted

"""The served routing of a replayed forward, rebuilt from the digest the engine recorded for it.

The replay computes its own router scores; they equal the served ones only to float rounding (other kernel
shapes, other prefill chunks). Where a token's k-th expert and the best one not chosen were a rounding error
apart, the served router may have picked the other one, and from that layer on the token's hidden state --
hence its K/V, hence any int8 copy of them -- differs by far more than rounding. The engine records, per step
× request × layer, a digest of the experts its forward routed to (``experts.routing.request_digests``); the
replay compares its own and, on a mismatch, swaps the k-th expert for the next at the tokens nearest such a
tie (one, two or three at a time) until the digests agree, and computes with the served choice. A routing
that no near-tie explains is a :class:`RoutingError`: the served forward did not route what its inputs give.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import torch

from fallbackgate.audit.replay_trace import TraceError
from fallbackgate.engine.experts.routing import DIGEST_MASK, digest_sum, digest_terms

ROUTING_TIE = 1e-5  # router-score gap (logits) within which rounding may swap the k-th expert and the next
# In a 16-bit dtype the replay's router scores differ from the served ones by that dtype's rounding of every
# layer before (bf16 keeps 8 bits: a score of 4 has steps of 0.03), so the window is also this many steps of
# the token's largest score; a swap still has to reproduce the recorded 64-bit digest exactly.
TIE_STEPS_16BIT = 8
MAX_CANDIDATES = 64  # tokens nearest a tie tried
MAX_FLIPS = 3  # swaps tried together


class RoutingError(TraceError):
    """A replayed forward's routing differs from the served one beyond what router near-ties explain."""


def tie_window(scores: torch.Tensor) -> np.ndarray:
    """Per token, the score gap within which rounding may have swapped the k-th expert and the next: ROUTING_TIE,
    and in a 16-bit dtype at least TIE_STEPS_16BIT of its rounding steps at the token's largest score."""
    window = np.full(scores.shape[0], ROUTING_TIE)
    if scores.dtype in (torch.bfloat16, torch.float16):
        step = torch.finfo(scores.dtype).eps * scores.detach().float().abs().amax(dim=1).cpu().numpy()
        window = np.maximum(window, TIE_STEPS_16BIT * step)
    return window


def _candidates(ids: np.ndarray, scores: np.ndarray, window: np.ndarray) -> list[tuple[int, int, int, float]]:
    """(token, top-k slot, replacement expert, gap) for the tokens whose weakest chosen expert is within
    `window` (per token) of the best one not chosen, nearest first."""
    rows = np.arange(ids.shape[0])[:, None]
    chosen = np.take_along_axis(scores, ids, axis=1)
    slot = chosen.argmin(axis=1)
    others = scores.copy()
    others[rows, ids] = -np.inf
    best = others.argmax(axis=1)
    gap = chosen[np.arange(len(ids)), slot] - others[np.arange(len(ids)), best]
    near = np.flatnonzero(np.abs(gap) < window)
    near = near[np.argsort(np.abs(gap[near]), kind="stable")][:MAX_CANDIDATES]
    return [(int(t), int(slot[t]), int(best[t]), float(gap[t])) for t in near]


def _find_swaps(deltas: list[int], missing: int) -> tuple[int, ...] | None:
    """Indices of at most MAX_FLIPS deltas whose sum is `missing` (mod 2**64), fewest first."""
    singles: dict[int, int] = {}
    for i, d in enumerate(deltas):
        singles.setdefault(d, i)
    if missing in singles:
        return (singles[missing],)
    for size in range(2, MAX_FLIPS + 1):
        for combo in itertools.combinations(range(len(deltas)), size - 1):
            rest = (missing - sum(deltas[i] for i in combo)) & DIGEST_MASK
            last = singles.get(rest)
            if last is not None and last > combo[-1]:
                return (*combo, last)
    return None


def served_routing(
    top_k_index: torch.Tensor,
    positions: np.ndarray,
    recorded: int,
    scores: Callable[[], torch.Tensor],
    where: str,
) -> tuple[torch.Tensor, int]:
    """The forward's `top_k_index` [n, k] (tokens at `positions`) as the served forward routed it, and how
    many tokens were swapped; `scores()` gives the router's scores [n, num_experts] (asked only on a
    mismatch). A token swapped keeps the weight of the expert it replaces: the two were within a rounding of
    each other (:func:`tie_window`)."""
    ids = top_k_index.detach().cpu().numpy()
    missing = (recorded - digest_sum(digest_terms(positions, ids))) & DIGEST_MASK
    if not missing:
        return top_k_index, 0
    raw = scores()
    window = tie_window(raw)
    found = _candidates(ids, raw.detach().float().cpu().numpy(), window)
    tokens, slots, news = (np.array([c[i] for c in found], dtype=np.int64) for i in range(3))
    swapped_in = digest_terms(positions[tokens], news[:, None])[:, 0]  # what each swap adds and removes
    swapped_out = digest_terms(positions[tokens], ids[tokens, slots][:, None])[:, 0]
    deltas = [(int(a) - int(b)) & DIGEST_MASK for a, b in zip(swapped_in, swapped_out, strict=True)]
    swaps = _find_swaps(deltas, missing)
    if swaps is None:
        raise RoutingError(
            f"{where}: the replay's routing differs from the served one (digest {recorded:016x}) and no swap of "
            f"the k-th expert at up to {MAX_FLIPS} of the {len(found)} tokens within {float(window.max()):.3g} of a "
            "router tie gives it: the served forward did not route what its inputs give"
        )
    served = top_k_index.clone()
    for i in swaps:
        token, slot, new, _ = found[i]
        served[token, slot] = new
    return served, len(swaps)

"""A small LRU cache simulator over a trace's access sequence, all sizes at once via LRU stack distances.

An access hits an LRU cache of ``C`` objects iff fewer than ``C`` distinct other objects were accessed since
the object's previous access (its stack distance). Distances are computed in O(n log² n) with numpy only: the
distance of access i with previous access p is ``(i - p - 1) - #{j < i : prev_j > p}``, and the count is
taken level by level of a merge (pairs of blocks, searchsorted on one sorted array with segment offsets).
"""

from __future__ import annotations

import dataclasses

import numpy as np


def previous_access(keys: np.ndarray) -> np.ndarray:
    """For each access, the index of the previous access to the same key (-1 for the first)."""
    n = len(keys)
    order = np.argsort(keys, kind="stable")
    prev = np.full(n, -1, dtype=np.int64)
    same = keys[order][1:] == keys[order][:-1]
    prev[order[1:][same]] = order[:-1][same]
    return prev


def stack_distances(keys: np.ndarray) -> np.ndarray:
    """LRU stack distance of every access (distinct other keys since its previous access; -1: first access)."""
    keys = np.asarray(keys)
    n = len(keys)
    prev = previous_access(keys)
    index = np.arange(n, dtype=np.int64)
    later_prev = np.zeros(n, dtype=np.int64)  # #{j < i : prev_j > prev_i}
    shifted = prev + 1  # in [0, n]
    span = n + 2
    width = 1
    while width < n:
        segment = index // (2 * width)
        is_left = (index % (2 * width)) < width
        left = np.sort(shifted[is_left] + segment[is_left] * span)
        queries = shifted[~is_left] + segment[~is_left] * span
        segment_end = np.searchsorted(left, (segment[~is_left] + 1) * span, side="left")
        later_prev[~is_left] += segment_end - np.searchsorted(left, queries, side="right")
        width *= 2
    distances = (index - prev - 1) - later_prev
    return np.where(prev >= 0, distances, -1)


@dataclasses.dataclass(slots=True)
class AccessStream:
    """One kind's accesses in trace order, ready to price at any cache size."""

    steps: np.ndarray  # step of each access
    distances: np.ndarray  # stack distance of each access (-1: first access)
    bytes_per_object: int  # every object of the kind has this size
    is_first_a_miss: bool  # experts: a first access loads from home; KV: it is the block being written

    @classmethod
    def from_keys(cls, steps: np.ndarray, keys: np.ndarray, bytes_per_object: int, is_first_a_miss: bool):
        """Build from per-access steps and object keys (any integer encoding, one per distinct object)."""
        return cls(np.asarray(steps), stack_distances(keys), int(bytes_per_object), is_first_a_miss)

    def is_miss(self, capacity_bytes: float) -> np.ndarray:
        """Per access: whether an LRU of ``capacity_bytes`` misses it."""
        capacity = int(capacity_bytes // self.bytes_per_object) if self.bytes_per_object else 0
        first = self.distances < 0
        return np.where(first, self.is_first_a_miss, self.distances >= capacity)

    def misses_per_step(self, capacity_bytes: float, step_index: np.ndarray, num_steps: int) -> np.ndarray:
        """Miss counts per step position (``step_index`` maps each access's step to 0..num_steps-1)."""
        return np.bincount(step_index, weights=self.is_miss(capacity_bytes), minlength=num_steps)

"""Offline bounds on a recorded run's bytes read: Belady's MIN per kind and FOO's LP for both kinds at once.

Both work on a trace (format v1) of the run, at step granularity: within a step an object used twice costs
one access (the engine holds it for the step), so the access sequence is, step by step and layer by layer,
each distinct KV block ``(request, layer, block)`` the step reads, then each distinct expert ``(layer,
expert)`` it computes. An expert's first use is a compulsory read from the checkpoint; a KV block's first use
is its creation (computed, written, never read), so only its later uses can cost a read.

- :func:`belady_by_kind`: Belady's MIN per kind alone, with the slots a split gives each kind (labelled so: a
  bound for a static split at that split, not for a shared budget).
- :func:`foo_lower_bound`: FOO's linear relaxation (Berger, Beckmann, Harchol-Balter, SIGMETRICS 2018) for
  variable-size objects in one cache of ``capacity`` bytes, minimising bytes read. Each reuse interval of an
  object gets a variable x in [0, 1] (the fraction kept across it); the bytes read are the sum of
  size × (1 − x) plus the compulsory expert reads. Capacity is enforced at every step boundary (the objects
  kept across it); dropping FOO's within-step constraints only loosens the relaxation, so the optimum is
  still a lower bound on the bytes any policy, joint or split, must read under that RAM budget.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

import numpy as np
import pandas as pd
from scipy.optimize import linprog
from scipy.sparse import csr_matrix

from fallbackgate.sweep.belady import belady_misses

Key = Hashable


@dataclasses.dataclass(slots=True)
class StepTrace:
    """Per step, the distinct objects it used, in use order, and the two object sizes."""

    steps: list[tuple[list[Key], list[Key]]]  # (KV blocks, experts) per step
    bytes_per_expert: int
    bytes_per_kv_block: int
    step_ids: list[int] = dataclasses.field(default_factory=list)  # each step's id in the run (empty: unknown)

    @property
    def expert_sequence(self) -> list[Key]:
        """Every step's experts, concatenated."""
        return [k for _, experts in self.steps for k in experts]

    @property
    def kv_sequence(self) -> list[Key]:
        """Every step's KV blocks, concatenated."""
        return [k for kv, _ in self.steps for k in kv]


def step_trace(
    expert_access: pd.DataFrame, kv_access: pd.DataFrame, bytes_per_expert: int, bytes_per_kv_block: int
) -> StepTrace:
    """The step-granular access sequence of a trace's ``expert_access`` and ``kv_access`` tables."""
    experts = expert_access.drop_duplicates(["step", "layer", "expert"])[["step", "layer", "expert"]]
    kv = kv_access.drop_duplicates(["step", "request", "layer", "block"])[["step", "request", "layer", "block"]]
    by_step_e: dict[int, list[Key]] = {}
    for step, layer, expert in experts.itertuples(index=False):
        by_step_e.setdefault(int(step), []).append(("e", int(layer), int(expert)))
    by_step_k: dict[int, list[Key]] = {}
    for step, request, layer, block in kv.sort_values(["step", "layer"], kind="stable").itertuples(index=False):
        by_step_k.setdefault(int(step), []).append(("k", str(request), int(layer), int(block)))
    ids = sorted(set(by_step_e) | set(by_step_k))
    steps = [(by_step_k.get(s, []), by_step_e.get(s, [])) for s in ids]
    return StepTrace(steps, bytes_per_expert, bytes_per_kv_block, ids)


def belady_by_kind(trace: StepTrace, expert_bytes: int, kv_bytes: int) -> dict[str, float]:
    """Bytes Belady's MIN reads for each kind alone: experts in ``expert_bytes``, KV in ``kv_bytes`` (compulsory
    expert reads counted, KV creations not)."""
    experts, kv = trace.expert_sequence, trace.kv_sequence
    e_slots = expert_bytes // trace.bytes_per_expert
    k_slots = kv_bytes // trace.bytes_per_kv_block
    e_reads = _min_reads(experts, e_slots)
    k_reads = _min_reads(kv, k_slots) - len(set(kv)) if kv else 0
    return {
        "belady_expert_bytes": float(e_reads * trace.bytes_per_expert),
        "belady_kv_bytes": float(max(0, k_reads) * trace.bytes_per_kv_block),
        "belady_expert_slots": float(e_slots),
        "belady_kv_slots": float(k_slots),
    }


def belady_expert_at_room(trace: StepTrace, expert_room_by_step: dict[int, int]) -> dict[str, float]:
    """Bytes Belady's MIN reads for experts with the room the run itself gave experts step by step
    (`expert_room_by_step`: step id -> expert bytes held after that step): during a step, the larger of
    the rooms after it and after the step before, at least one expert (a cold start holds none). The same
    memory as the run at every step, so the ratio to it measures which experts a policy kept, not how much
    room it gave them. Steps with no room known get the largest room of the run."""
    if not trace.step_ids:
        raise ValueError("the trace has no step ids: build it with step_trace")
    per_expert = trace.bytes_per_expert
    largest = max(expert_room_by_step.values(), default=0)
    slots, rooms, before = [], [], 0
    for step_id, (_, experts) in zip(trace.step_ids, trace.steps, strict=True):
        after = expert_room_by_step.get(step_id, largest)
        room = max(1, max(before, after) // per_expert)
        slots += [room] * len(experts)
        rooms.append(room)
        before = after
    reads = belady_misses(trace.expert_sequence, slots) if slots else 0
    return {
        "belady_expert_bytes_same_room": float(reads * per_expert),
        "belady_same_room_mean_slots": float(np.mean(rooms)) if rooms else 0.0,
    }


def _min_reads(sequence: Sequence[Key], slots: int) -> int:
    if not sequence:
        return 0
    if slots < 1:  # nothing can stay: every use is a read
        return len(sequence)
    return belady_misses(sequence, slots)


def foo_lower_bound(trace: StepTrace, capacity: int) -> dict[str, float]:
    """FOO's LP lower bound on bytes read with ``capacity`` bytes shared by experts and KV (see the module)."""
    sizes: list[int] = []
    starts: list[int] = []
    ends: list[int] = []
    last_seen: dict[Key, int] = {}
    compulsory = 0
    for index, (kv, experts) in enumerate(trace.steps):
        for key in (*kv, *experts):
            size = trace.bytes_per_expert if key[0] == "e" else trace.bytes_per_kv_block
            if key in last_seen:
                sizes.append(size)
                starts.append(last_seen[key])
                ends.append(index)
            elif key[0] == "e":
                compulsory += size
            last_seen[key] = index
    reuse_bytes = float(sum(sizes))
    if not sizes:
        return {"foo_lb_bytes": float(compulsory), "foo_compulsory_bytes": float(compulsory), "foo_status": 0.0}
    rows, cols, vals = [], [], []
    for var, (s, e, size) in enumerate(zip(starts, ends, sizes, strict=True)):
        for boundary in range(s, e):  # boundary b lies between step b and step b + 1
            rows.append(boundary)
            cols.append(var)
            vals.append(float(size))
    n_boundaries = max(1, len(trace.steps) - 1)
    a_ub = csr_matrix((vals, (rows, cols)), shape=(n_boundaries, len(sizes)))
    result = linprog(
        -np.asarray(sizes, dtype=float),  # maximise the bytes kept across their reuse intervals
        A_ub=a_ub,
        b_ub=np.full(n_boundaries, float(capacity)),
        bounds=(0.0, 1.0),
        method="highs",
    )
    if result.status != 0:
        raise RuntimeError(f"FOO LP did not solve: {result.message}")
    kept = -float(result.fun)
    return {
        "foo_lb_bytes": float(compulsory) + max(0.0, reuse_bytes - kept),
        "foo_compulsory_bytes": float(compulsory),
        "foo_status": float(result.status),
    }

"""The expert side of :mod:`fallbackgate.bench.controller_cost`: what a miss and a step cost the joint
controller's expert bookkeeping and the copy verifier, old (walks of every expert, kept in
:mod:`fallbackgate.bench.victims_reference`) against new (the residency journal and the structures that
follow it), on one bench state.

Every timed call first changes what a miss or a step changes, the same for old and new:

- ``expert_victims_after_miss``: one device expert evicted and one loaded (journaled), then the 8 cheapest
  device experts (old: value and heapify every device expert; new: sync the ranking, read 8 off it);
- ``joint_step_values``: the step end's frequency update for the state's used experts (old: decay every
  frequency; new: the scaled update, then the ranking's sync);
- ``copy_sample``: 16 copies come or go, then the verifier's sampled copy (old: walk every expert entry;
  new: the journaled, sorted copy list).
"""

from __future__ import annotations

import gc
import itertools
import random
import types
from collections.abc import Callable
from typing import Any

import torch

from fallbackgate.bench import victims_reference as ref
from fallbackgate.controllers.expert_rank import ExpertRanking
from fallbackgate.controllers.values import ValueModel
from fallbackgate.engine.controller import ControllerView
from fallbackgate.engine.experts.integrity import CopyVerifier
from fallbackgate.engine.experts.journal import ChangeLog
from fallbackgate.engine.tags import Tier

TAKEN = 8  # victims a miss takes
FLIPS_PER_STEP = 16  # copies that come or go between two verifier samples


class ExpertTable:
    """The bench's expert residency as a store keeps it: entries with device and host copies, a journal."""

    def __init__(self, on_device: dict, homes: dict) -> None:
        held = object()  # a stand-in copy: the rows time bookkeeping, not bytes
        self.entries = {
            k: types.SimpleNamespace(device=held if is_on else None, host=held if homes[k] is Tier.HOST else None)
            for k, is_on in on_device.items()
        }
        self.journal: ChangeLog = ChangeLog(4 * len(self.entries))
        self.on_device = on_device

    def flip(self, rng: random.Random) -> None:
        """A miss: one device expert evicted, one off-device expert loaded (both journaled)."""
        keys = list(self.entries)
        for is_on in (True, False):
            key = next(k for k in iter(lambda: rng.choice(keys), None) if self.on_device[k] is is_on)
            self.on_device[key] = not is_on
            self.entries[key].device = None if is_on else object()
            self.journal.record(key)


MedianSeconds = Callable[[Callable[[], Any], int], float]  # (call, reps) -> median seconds per call


def expert_rows(
    view: ControllerView, table: ExpertTable, values: ValueModel, reps: int, median_s: MedianSeconds
) -> dict[str, dict[str, float]]:
    """Old against new for each expert-side row on `view`, whose residency `table` holds (seconds per call;
    see the module docstring)."""
    gc.collect()  # the garbage of the old rows' full sorts, collected before these rows are timed
    rng = random.Random(1)
    ranking = ExpertRanking()
    ranking.sync(view, values)
    rows = {
        "expert_victims_after_miss": _victims_row(view, table, values, ranking, rng, reps, median_s),
        "joint_step_values": _values_row(view, values, ranking, reps, median_s),
        "copy_sample": _copies_row(table, rng, reps, median_s),
    }
    for row in rows.values():
        row["ratio"] = row["old_s"] / max(row["new_s"], 1e-9)
    return rows


def _victims_row(
    view: ControllerView,
    table: ExpertTable,
    values: ValueModel,
    ranking: ExpertRanking,
    rng: random.Random,
    reps: int,
    median_s: MedianSeconds,
) -> dict[str, float]:
    """The first victims after a miss: the full valuation against the kept ranking (checked equal first)."""

    def victims_old() -> list:
        table.flip(rng)
        return ref.joint_expert_victims(values, view, set(), TAKEN)

    def victims_new() -> list:
        table.flip(rng)
        ranking.sync(view, values)
        return [key for _, key in itertools.islice(ranking.victims(view, values), TAKEN)]

    if victims_new() != ref.joint_expert_victims(values, view, set(), TAKEN):
        raise AssertionError("expert victims: the ranking's first victims differ from the full valuation's")
    return {"old_s": median_s(victims_old, reps), "new_s": median_s(victims_new, reps)}


def _values_row(
    view: ControllerView, values: ValueModel, ranking: ExpertRanking, reps: int, median_s: MedianSeconds
) -> dict[str, float]:
    """A step's value update: decaying every frequency against the scaled update (checked equal after)."""
    old_freq = dict(values.frequencies())
    used = set(view.used_expert_keys)

    def step_new() -> None:
        values.update(view)
        ranking.sync(view, values)

    gc.collect()
    row = {
        "old_s": median_s(lambda: ref.decay_walk(old_freq, values.decay, used), reps),
        "new_s": median_s(step_new, reps),
    }
    new_freq = dict(values.frequencies())
    is_off = any(abs(old_freq[k] - f) > 1e-9 * f for k, f in new_freq.items() if k in old_freq)
    if old_freq.keys() != new_freq.keys() or is_off:
        raise AssertionError("frequencies: the scaled update differs from decaying every frequency")
    return row


def _copies_row(table: ExpertTable, rng: random.Random, reps: int, median_s: MedianSeconds) -> dict[str, float]:
    """The copy a step verifies: a walk of every entry against the journaled list (checked equal after)."""
    verifier = CopyVerifier(table, torch.float32, num_per_step=1)  # type: ignore[arg-type]
    verifier._copies()

    def copies_old() -> list:
        for _ in range(FLIPS_PER_STEP // 2):
            table.flip(rng)
        return verifier.rng.sample(ref.copies_walk(table.entries), 1)

    def copies_new() -> list:
        for _ in range(FLIPS_PER_STEP // 2):
            table.flip(rng)
        return verifier.rng.sample(verifier._copies(), 1)

    row = {"old_s": median_s(copies_old, reps), "new_s": median_s(copies_new, reps)}
    if verifier._copies() != ref.copies_walk(table.entries):
        raise AssertionError("copies: the journaled copy list differs from a walk of every entry")
    return row

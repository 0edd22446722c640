"""Marginal value per device byte of expert slots and KV blocks, for the joint controller.

- expert: misses avoided per step (decayed per-layer routing frequency of that expert: the share of steps
  that use it, as a use adds 1 − decay) × its load time;
- KV block: one read per step while its request runs × its cheapest acceptable reload time from where a
  spilled block goes (host memory; the disk on a CPU), a quantized copy when its class may read one, else the
  full block; 0 for requests not running;
- kept prefix block: its reuse rate, (s + adoptions) / (1 + steps idle), × the time to read it back from
  the tier it would go to (the disk on a CPU), so a hot prefix outranks a cold expert and a cold one leaves
  first; s, the prior of a block not adopted yet, is the run's adoptions per kept block so far (at most 1;
  1 before any was kept), so where prefixes are seldom reused they give their room to experts sooner.
Values are seconds saved per step per byte, so both sides compare in one unit.

Frequencies are kept divided by the decay every one of them shares (``frequency = scaled × scale``), so a
step end touches only the experts used or deferred in it and those whose frequency fell below the prune
floor (a min-heap finds them); every change is logged for the rankings built on these values
(:mod:`fallbackgate.controllers.expert_rank`). When the shared scale gets tiny every frequency is folded
back in once (a new ``epoch``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping

from fallbackgate.engine.controller import ControllerView
from fallbackgate.engine.experts.journal import ChangeLog
from fallbackgate.engine.experts.store import ExpertKey
from fallbackgate.engine.kv.prefix_cache import PrefixEntryInfo
from fallbackgate.engine.kv.store import KVBlockKey
from fallbackgate.engine.tags import Tier

PRUNE_BELOW = 1e-6  # a frequency below this, not used in the step, is forgotten (0)
RENORMALIZE_BELOW = 1e-150  # the shared scale is folded into the frequencies below this
LOG_KEPT = 1 << 17  # frequency changes the log keeps at least


class ValueModel:
    """Decayed routing frequencies and the value-per-byte estimates built on them."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self.scaled: dict[ExpertKey, float] = {}  # frequency / scale
        self.scale = 1.0  # the decay all frequencies share since the last renormalization
        self.epoch = 0  # renormalizations so far (scaled values are comparable within one epoch)
        # keys whose frequency changed other than by the decay; a step logs its used experts, so the log keeps
        # many steps of the largest models (a reader that falls behind rebuilds once)
        self.log: ChangeLog[ExpertKey] = ChangeLog(LOG_KEPT)
        self.num_updates = 0
        self._due: dict[ExpertKey, int] = {}  # key -> the update at which its prune check is due
        self._checks: dict[int, list[ExpertKey]] = {}  # update -> keys due then (stale ones skipped)
        self._profile: object = None  # the profile `_transfer_seconds` were computed from
        self._transfer_seconds: dict[tuple[int, Tier], float] = {}  # (bytes, source tier) -> seconds to device

    def frequency(self, key: ExpertKey) -> float:
        """The decayed routing frequency of `key` (0 when never used or forgotten)."""
        return self.scaled.get(key, 0.0) * self.scale

    def scaled_freq(self, key: ExpertKey) -> float:
        """`frequency(key)` without the shared decay: comparable between keys within one epoch."""
        return self.scaled.get(key, 0.0)

    def frequencies(self) -> Iterator[tuple[ExpertKey, float]]:
        """Every remembered key with its frequency."""
        scale = self.scale
        return ((key, scaled * scale) for key, scaled in self.scaled.items())

    def set_frequencies(self, freq: Mapping[ExpertKey, float]) -> None:
        """Set the frequencies of the given keys (a seeded state)."""
        for key, value in freq.items():
            self._set(key, value / self.scale)

    def changes_since(self, cursor: int) -> tuple[list[ExpertKey] | None, int]:
        """Keys whose frequency changed since `cursor` (see :class:`ChangeLog`)."""
        return self.log.since(cursor)

    def update(self, view: ControllerView) -> None:
        """Decay every frequency and count the last step's used and deferred experts once each: O(used +
        forgotten), never a walk of every frequency (a key's prune check is scheduled for the update at
        which its decayed frequency is due to fall below PRUNE_BELOW)."""
        used = set(view.used_expert_keys) | set(view.deferred_expert_keys)
        self.num_updates += 1
        self.scale *= self.decay
        scaled, due = self.scaled, self._due
        for key in self._checks.pop(self.num_updates, ()):
            if due.get(key) != self.num_updates or key in used:  # rescheduled by a later use, or used now
                continue
            if scaled[key] * self.scale < PRUNE_BELOW:
                del scaled[key], due[key]
                self.log.record(key)
            else:  # checked early (its frequency was above the least a use leaves): when it is really due
                self._schedule(key)
        if self.scale < RENORMALIZE_BELOW:
            self.scaled = scaled = {key: value * self.scale for key, value in scaled.items()}
            self.scale, self.epoch = 1.0, self.epoch + 1
        step = (1.0 - self.decay) / self.scale
        # a frequency just used is at least 1 - decay: checked no later than such a one would fall below the floor
        check = self.num_updates + self._min_updates
        due_now = self._checks.setdefault(check, [])
        for key in used:  # this loop is the step end's cost: no call per key
            scaled[key] = scaled.get(key, 0.0) + step
            due[key] = check
            due_now.append(key)
        self.log.extend(used)

    @property
    def _min_updates(self) -> int:
        """Updates a frequency of 1 - decay (the least a use leaves) takes to fall below the floor, at least 1."""
        if not 0.0 < self.decay < 1.0:
            return 1
        return max(1, math.floor(math.log(PRUNE_BELOW / (1.0 - self.decay)) / math.log(self.decay)))

    def _set(self, key: ExpertKey, scaled: float) -> None:
        self.scaled[key] = scaled
        self.log.record(key)
        self._schedule(key)

    def _schedule(self, key: ExpertKey) -> None:
        """Schedule `key`'s prune check no later than the update at which its frequency falls below the floor."""
        freq = self.scaled[key] * self.scale
        if self.decay >= 1.0 and freq >= PRUNE_BELOW:
            self._due.pop(key, None)  # never decays: never pruned
            return
        updates = 1
        if 0.0 < self.decay < 1.0 and freq > PRUNE_BELOW:
            updates = max(1, math.floor(math.log(PRUNE_BELOW / freq) / math.log(self.decay)))
        self._check_at(key, self.num_updates + updates)

    def _check_at(self, key: ExpertKey, update: int) -> None:
        self._due[key] = update
        self._checks.setdefault(update, []).append(key)

    def expert_value(self, key: ExpertKey, view: ControllerView) -> float:
        """Seconds saved per step per byte by keeping `key` on device."""
        freq = self.frequency(key)
        if not freq:
            return 0.0
        return freq * self.load_s(view, view.expert_home(key)) / view.bytes_per_expert

    def expert_urgency(self, key: ExpertKey, view: ControllerView, current_layer: int) -> float:
        """Seconds per byte saved by keeping `key` on device, weighted by how soon it is needed again: the
        victim order of the joint controller (lowest first; Belady's MIN evicts the farthest next use).

        Its layer is read once per step and uses it with probability ``p``, its frequency (the share of steps
        that used it); after `current_layer` (-1: the step's start) its layer comes ``D`` of the ``N``
        decoder layers later, so its next use is expected ``T = D/N + 1/p − 1`` steps away and the order is
        load seconds per byte ÷ ``T``. For an expert whose layer just ran (``D = N``) that is
        ``expert_value``; 0 when never used. A layer walk whose experts do not fit then evicts the experts
        whose layer has just run, not the least recently used ones."""
        freq = self.frequency(key)
        if not freq:
            return 0.0
        num_layers = view.num_layers
        distance = (key[0] - current_layer - 1) % num_layers + 1
        seconds = self.load_s(view, view.expert_home(key))
        share = min(1.0, freq)  # a seeded frequency may exceed what uses can leave
        return seconds / view.bytes_per_expert / (distance / num_layers + 1.0 / share - 1.0)

    def expert_values(self, keys: Iterable[ExpertKey], view: ControllerView) -> list[tuple[ExpertKey, float]]:
        """`expert_value` of each key, in order (the same floats; each home tier's load time computed once)."""
        num_bytes = view.bytes_per_expert
        out = []
        for key in keys:
            freq = self.frequency(key)
            out.append((key, freq * self.load_s(view, view.expert_home(key)) / num_bytes if freq else 0.0))
        return out

    def load_s(self, view: ControllerView, home: Tier) -> float:
        """Seconds to bring one expert from `home` to device (``view.profile.transfer_s``)."""
        return self.transfer_s(view, view.bytes_per_expert, home)

    def transfer_s(self, view: ControllerView, num_bytes: int, source: Tier) -> float:
        """``view.profile.transfer_s(num_bytes, source)`` (the same float), remembered while the view's profile
        is the same object: the victim walks ask it for every object they value."""
        profile = view.profile
        if profile is not self._profile:
            self._profile, self._transfer_seconds = profile, {}
        key = (num_bytes, source)
        seconds = self._transfer_seconds.get(key)
        if seconds is None:
            seconds = self._transfer_seconds[key] = profile.transfer_s(num_bytes, source)
        return seconds

    def kv_value(self, key: KVBlockKey, view: ControllerView, running: set[str], reload_fraction: float = 1.0) -> float:
        """Seconds saved per step per byte by keeping KV block `key` on device (0 when its request is idle)."""
        if key[0] not in running:
            return 0.0
        num_bytes = view.bytes_per_kv_block
        seconds = self.transfer_s(view, max(1, int(num_bytes * reload_fraction)), _spill_tier(view))
        return seconds / num_bytes

    def prefix_value(self, entry: PrefixEntryInfo, view: ControllerView) -> float:
        """Seconds saved per step per byte by keeping a kept prefix block in the fast tier."""
        num_bytes = view.bytes_per_kv_block
        rate = min(1.0, (min(1.0, entry.reuse_share) + entry.num_hits) / (1 + entry.idle_steps))
        seconds = self.transfer_s(view, num_bytes, _spill_tier(view))
        return rate * seconds / num_bytes


def _spill_tier(view: ControllerView) -> Tier:
    """Where a KV block that leaves the fast tier is read back from: the disk on a CPU (RAM is the fast tier),
    else host memory."""
    return Tier.DISK if view.is_ram_tiered else Tier.HOST

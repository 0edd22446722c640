"""The host cache of full-precision expert copies and the disk reads that fill it: reads on demand, and
reads ahead in read slots whose host room the cache leaves free (a read ahead never evicts a cached copy).

Mechanism only: the store decides what to place; this part keeps copies while the host budget allows.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Mapping
from typing import Protocol

from fallbackgate.engine.device_pool import Scratch, TierPool
from fallbackgate.engine.errors import EngineError
from fallbackgate.engine.experts import fp8_experts
from fallbackgate.engine.experts.journal import ChangeLog
from fallbackgate.engine.experts.quarantine import ExpertQuarantined, read_checked_stored
from fallbackgate.engine.experts.read_ahead import ReadAhead
from fallbackgate.engine.experts.reader import ExpertReader
from fallbackgate.engine.experts.sources import ExpertKey
from fallbackgate.engine.experts.weights import ExpertWeights, Fetched, HeldWeights
from fallbackgate.engine.pinned_memory import PinnedHostCopies, footprint
from fallbackgate.engine.tags import ObjectKind, Tier

READ_SLOTS = 8  # experts read ahead at once at most

log = logging.getLogger(__name__)


class HoldsFull(Protocol):
    """What the host cache reads of a store entry."""

    host: HeldWeights | None
    device: ExpertWeights | None


class HostCache:
    """Full-precision host copies (each in its entry's ``host``), least recently used first to go, and the reads.

    A copy is held as the checkpoint stores it when that is FP8 (codes and scales: `BlockScaled`, counted at
    those bytes) and dequantized per use (`read_home`, `read_home_held` + `fp8_experts.write_into`); other
    checkpoints' copies are held in the compute dtype. With a `pinner` (CUDA) each copy is page-locked, counted
    at its locked footprint."""

    def __init__(
        self,
        reader: ExpertReader,
        entries: Mapping[ExpertKey, HoldsFull],
        journal: ChangeLog[ExpertKey],
        host_pool: TierPool,
        staging_pool: TierPool,
        num_io_threads: int,
        is_ram_tiered: bool,
        pinner: PinnedHostCopies | None = None,
    ) -> None:
        self.reader, self.entries, self.journal = reader, entries, journal
        self.host_pool, self.staging_pool = host_pool, staging_pool  # staging: holds the reads ahead in flight
        self.is_ram_tiered = is_ram_tiered
        self.pinner = pinner  # CUDA: locks each cached copy for asynchronous copies to the device
        self.held_bytes_per_expert = reader.held_bytes_per_expert  # a copy's tensors (what a use moves)
        # what a copy holds in memory (pools count it): a locked copy is page-rounded
        held_bytes = self.held_bytes_per_expert
        self.bytes_per_expert = footprint(held_bytes) if pinner is not None else held_bytes
        self.num_unpinned = 0  # copies cached pageable: no host room for the pageable read beside the locked copy
        self.checkpoint_bytes_per_expert = reader.checkpoint_bytes_per_expert  # what a read takes from the files
        self.lru: collections.OrderedDict[ExpertKey, None] = collections.OrderedDict()
        self.num_disk_reads = 0
        self.read_ahead = ReadAhead(self.verified_read, num_io_threads)
        self.is_disk_tiered = False  # some expert's only copy is the checkpoint on disk
        host_slots = staging_pool.budget_bytes // max(1, self.bytes_per_expert)
        # experts that may be read ahead at once; their host room is kept out of the cache's reach
        self.num_read_slots = min(READ_SLOTS, max(1, host_slots // 4)) if num_io_threads and host_slots >= 2 else 0
        self.pending_reads: list[tuple[ExpertKey, bool]] = []  # (key, is_predicted) waiting for a read slot
        self.pending_step_id = 0
        self.read_ahead_cached: set[ExpertKey] = set()  # host copies read ahead and not used yet: from disk

    def warm(self) -> int:
        """Fill the host cache in key order while it has room (what a fresh process would read first)."""
        num_read = 0
        room = self.bytes_per_expert * (2 if self.pinner is not None else 1)  # a locked copy is made beside its read
        for key in self.entries:
            if not self.host_pool.can_reserve(room + self.read_slot_bytes()):
                break
            try:
                self.cache(key, self.read_disk(key)[0], may_evict=False)
            except ExpertQuarantined:  # recorded; requests that route to it are told when they do
                continue
            num_read += 1
        self.is_disk_tiered = num_read < len(self.entries)
        self.read_ahead.end_step()  # warm-up reads are not a step's
        return num_read

    def queue_reads(self, needed: list[ExpertKey], predicted: list[ExpertKey], step_id: int) -> None:
        """Read ahead: the current layer's `needed` misses first, then the `predicted` experts of the next
        layer, replacing what an earlier layer queued; reads start as read slots free up (see `_pump`)."""
        if not self.num_read_slots:
            return
        queued = [(k, False) for k in needed] + [(k, True) for k in predicted if k not in set(needed)]
        self.pending_reads = [
            (k, is_p) for k, is_p in dict(queued).items() if self._is_disk_only(k) and k not in self.reader.quarantine
        ]
        self.pending_step_id = step_id
        self._pump()

    def close(self) -> None:
        """Stop the read threads, give back the host room of reads nobody took, unlock the locked copies."""
        self.read_ahead.close()
        self.staging_pool.release(ObjectKind.EXPERT, len(self.read_ahead.flights) * self.bytes_per_expert)
        self.read_ahead.flights.clear()
        self.pending_reads.clear()
        if self.pinner is not None:
            self.pinner.close()

    def _is_disk_only(self, key: ExpertKey) -> bool:
        entry = self.entries[key]
        return entry.device is None and entry.host is None and not self.read_ahead.is_in_flight(key)

    def _pump(self) -> None:
        """Start queued reads while a read slot is free: each holds its expert's host bytes, in room the host
        cache leaves free for them (so a read ahead never evicts a cached expert)."""
        while self.pending_reads and len(self.read_ahead.flights) < self.num_read_slots:
            key, is_predicted = self.pending_reads.pop(0)
            if not self._is_disk_only(key) or not self.staging_pool.can_reserve(self.bytes_per_expert):
                continue
            self.staging_pool.reserve(ObjectKind.EXPERT, self.bytes_per_expert)
            self.read_ahead.start(key, self.pending_step_id, is_predicted)

    def read_slot_bytes(self) -> int:
        """Host bytes the cache leaves free for read slots not in use."""
        return max(0, self.num_read_slots - len(self.read_ahead.flights)) * self.bytes_per_expert

    def settle_reads(self, step_id: int) -> None:
        """Reads started before `step_id` that nobody took become host-cache entries (their room was already
        reserved). Their first use reports the disk as its source, so the bytes are credited to the request
        that consumes them; one evicted unused is counted only in the transfer clock."""
        for key, weights in self.read_ahead.finished_before(step_id):
            entry = self.entries[key]
            is_room_kept = self.host_pool.free_bytes >= self.read_slot_bytes() + self.bytes_per_expert
            is_dropped = weights is None or entry.host is not None or entry.device is not None or not is_room_kept
            if is_dropped or self.is_ram_tiered:  # a CPU has no host cache to keep it in: read, then freed
                self.staging_pool.release(ObjectKind.EXPERT, self.bytes_per_expert)  # dropped: slots stay free
                continue
            entry.host = self._locked(weights)
            self.lru[key] = None
            self.journal.record(key)
            self.read_ahead_cached.add(key)

    def read_home(self, key: ExpertKey, is_cached: bool) -> Fetched:
        """The full-precision copy in the compute dtype (FP8: dequantized now, a fresh copy): the host
        cache's, else read from the checkpoint (kept when `is_cached`)."""
        held, fetched = self.read_home_held(key, is_cached)
        fetched.weights = fp8_experts.to_compute(held, self.reader.compute_dtype)
        return fetched

    def read_home_held(self, key: ExpertKey, is_cached: bool) -> tuple[HeldWeights, Fetched]:
        """The copy as held (FP8: codes and scales) and what getting it cost (its `weights` are the held
        copy when that is in the compute dtype; callers of an FP8 copy dequantize it where they use it)."""
        entry = self.entries[key]
        if entry.host is not None:
            held = entry.host
            self.lru.move_to_end(key)
            if key in self.read_ahead_cached:  # read from the checkpoint ahead, in an earlier step
                self.read_ahead_cached.discard(key)
                note = "read ahead in an earlier step"
                return held, Fetched(_as_weights(held), Tier.DISK, self.checkpoint_bytes_per_expert, note)
            return held, Fetched(_as_weights(held), Tier.HOST, self.held_bytes_per_expert)
        held, note = self.read_disk(key)
        if is_cached:
            self.make_room()
            if self.host_pool.can_reserve(self.bytes_per_expert + self.read_slot_bytes()):
                held = self.cache(key, held)
        return held, Fetched(_as_weights(held), Tier.DISK, self.checkpoint_bytes_per_expert, note)

    def read_disk(self, key: ExpertKey) -> tuple[HeldWeights, str]:
        """The expert from the checkpoint: a read started ahead (waited for), else a read now."""
        self.num_disk_reads += 1
        if self.read_ahead.is_in_flight(key):
            self.staging_pool.release(ObjectKind.EXPERT, self.bytes_per_expert)  # the caller places the bytes
            weights, note = self.read_ahead.take(key)
            self._pump()
            return weights, "; ".join(filter(None, ["read ahead", note]))
        return self.read_ahead.demand_read(key)

    def verified_read(self, key: ExpertKey) -> tuple[HeldWeights, str]:
        """A verified read, as held (FP8: codes and scales); one re-read clears a transient fault, a second
        failure quarantines the expert (ExpertQuarantined)."""
        return read_checked_stored(self.reader, key)

    def cache(self, key: ExpertKey, weights: HeldWeights, may_evict: bool = True) -> HeldWeights:
        """Keep `weights` as the host copy of `key` (the caller checked the room); returns the copy kept (with
        a pinner, a locked copy of `weights`; room for making it may evict an older copy when `may_evict`)."""
        self.host_pool.reserve(ObjectKind.EXPERT, self.bytes_per_expert)
        kept = self.entries[key].host = self._locked(weights, may_evict)
        self.lru[key] = None
        self.journal.record(key)
        return kept

    def _locked(self, weights: HeldWeights, may_evict: bool = True) -> HeldWeights:
        """With a pinner, a page-locked copy of `weights`, made while the host pool also holds the pageable read
        (room made as for a new copy when `may_evict`); left pageable, and counted in `num_unpinned`, when no
        room can be made or the runtime refuses to lock it."""
        if self.pinner is None:
            return weights
        if may_evict:
            self.free(self.bytes_per_expert + self.read_slot_bytes())  # an older copy goes, as for any new one
        if not self.host_pool.can_reserve(self.bytes_per_expert):
            self.num_unpinned += 1
            return weights
        with self.host_pool.held(Scratch.EXPERT_PIN, self.bytes_per_expert):
            try:
                return self.pinner.pin(weights)
            except EngineError as exc:
                log.warning("expert host copy left pageable: %s", exc)
                self.num_unpinned += 1
                return weights

    def drop(self, key: ExpertKey) -> None:
        """Drop the host copy of `key` (a locked copy is unlocked once copies out of it have completed)."""
        self.read_ahead_cached.discard(key)
        held = self.entries[key].host
        if self.pinner is not None and held is not None:
            self.pinner.unpin(held)
        self.entries[key].host = None
        del self.lru[key]
        self.journal.record(key)
        self.host_pool.release(ObjectKind.EXPERT, self.bytes_per_expert)

    def free(self, num_bytes: int) -> None:
        """Evict host copies, least recently used first, until `num_bytes` fit in the host pool."""
        while self.lru and not self.host_pool.can_reserve(num_bytes):
            self.drop(next(iter(self.lru)))

    def make_room(self) -> None:
        """Evict the least recently used host copy when the cache is full (it can be read again)."""
        self.free(self.bytes_per_expert + self.read_slot_bytes())


def _as_weights(held: HeldWeights) -> ExpertWeights:
    """The held copy as ExpertWeights: itself, or for FP8 its codes (a placeholder the caller replaces)."""
    return held if isinstance(held, ExpertWeights) else ExpertWeights(held.gate_up, held.down)

"""The audit's own expert copies: read from the checkpoint files and checked against the manifest, never
taken from the store, kept in a bounded LRU so the baselines do not re-read an expert on every pass.

Each copy owns its bytes on every device: a fresh allocation the read is copied into (``.to(device)`` alone
returns the reader's buffer on a CPU, a pooled mapping the serving reads recycle). Its xxh3-64 is taken
when it is filled and checked again on every CHECK_EVERY-th use and by :meth:`AuditWeights.verify_all` at
the end of an audit: a copy that changed is discarded (the next use reads the checkpoint again) and reported
as a failed :class:`~fallbackgate.engine.messages.Verification`.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import torch

from fallbackgate.engine.experts.manifest import weights_digest
from fallbackgate.engine.experts.quarantine import read_checked
from fallbackgate.engine.experts.reader import ExpertReader
from fallbackgate.engine.experts.sources import ExpertKey
from fallbackgate.engine.experts.weights import ExpertWeights
from fallbackgate.engine.messages import Verification

DEFAULT_CACHE_BYTES = 256 * 1024 * 1024
CHECK_EVERY = 64  # uses of a cached copy between re-checks of its checksum


@dataclasses.dataclass(slots=True)
class _Copy:
    weights: ExpertWeights  # the audit's own tensors
    digest: str  # xxh3-64 of their bytes when filled
    num_uses: int = 0


def own_copy(weights: ExpertWeights, device: torch.device) -> ExpertWeights:
    """`weights` copied into fresh tensors on `device` that share no storage with the source."""
    return ExpertWeights(*(torch.empty_like(t, device=device).copy_(t) for t in (weights.gate_up, weights.down)))


def _digest(weights: ExpertWeights) -> str:
    if weights.gate_up.device.type == "cpu":
        return weights_digest(weights)
    return weights_digest(ExpertWeights(weights.gate_up.cpu(), weights.down.cpu()))


class AuditWeights:
    """Verified file reads of experts for the exact baseline and the replay, up to `max_bytes` kept."""

    def __init__(self, reader: ExpertReader, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.reader, self.max_bytes = reader, max_bytes
        self._cache: OrderedDict[tuple[ExpertKey, str], _Copy] = OrderedDict()
        self.num_bytes = 0
        self.num_reads = 0  # file reads (cache misses)
        self.num_checks = 0  # checksum re-checks of cached copies
        self.failures: list[Verification] = []  # copies found changed, not yet taken by take_failures

    def get(self, key: ExpertKey, device: torch.device) -> ExpertWeights:
        """The expert as the checkpoint holds it (in the compute dtype), on `device`, in the audit's own memory."""
        slot = (key, str(device))
        cached = self._cache.get(slot)
        if cached is not None:
            cached.num_uses += 1
            if cached.num_uses % CHECK_EVERY or self._check(slot, cached):
                self._cache.move_to_end(slot)
                return cached.weights
        self.reader.is_checksum_verified, was = True, self.reader.is_checksum_verified  # never trust unchecked
        try:
            home, _ = read_checked(self.reader, key)  # retried once; quarantined after: ExpertQuarantined
        finally:
            self.reader.is_checksum_verified = was
        self.num_reads += 1
        weights = own_copy(home, device)
        self._cache[slot] = _Copy(weights, _digest(weights))
        self.num_bytes += weights.num_bytes
        while self.num_bytes > self.max_bytes and len(self._cache) > 1:
            _, dropped = self._cache.popitem(last=False)
            self.num_bytes -= dropped.weights.num_bytes
        return weights

    def _check(self, slot: tuple[ExpertKey, str], copy: _Copy) -> bool:
        """Re-check one cached copy; a changed one is dropped and recorded. True when it still matches."""
        self.num_checks += 1
        if _digest(copy.weights) == copy.digest:
            return True
        del self._cache[slot]
        self.num_bytes -= copy.weights.num_bytes
        (layer, expert_id), device = slot
        self.failures.append(
            Verification(
                None,
                "expert",
                f"{layer}:{expert_id}",
                None,
                False,
                f"the audit's own copy on {device} changed after it was filled and checked; discarded",
            )
        )
        return False

    def verify_all(self) -> list[Verification]:
        """Re-check every cached copy (the end of an audit); returns and clears every failure found since
        the last call, those of sampled uses included."""
        for slot, copy in list(self._cache.items()):
            self._check(slot, copy)
        failures, self.failures = self.failures, []
        return failures

    def storages(self) -> list[torch.Tensor]:
        """Every tensor the cache holds (to show it shares no storage with a serving buffer)."""
        return [t for c in self._cache.values() for t in (c.weights.gate_up, c.weights.down)]

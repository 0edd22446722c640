"""The audit's own expert copies: read from the checkpoint files and checked against the manifest, never
taken from the store, kept in a bounded LRU so the baselines do not re-read an expert on every pass."""

from __future__ import annotations

from collections import OrderedDict

import torch

from fallbackgate.engine.experts.reader import ExpertKey, ExpertReader
from fallbackgate.engine.experts.weights import ExpertWeights

DEFAULT_CACHE_BYTES = 256 * 1024 * 1024


class AuditWeights:
    """Verified file reads of experts for the exact baseline and the replay, up to `max_bytes` kept."""

    def __init__(self, reader: ExpertReader, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.reader, self.max_bytes = reader, max_bytes
        self._cache: OrderedDict[tuple[ExpertKey, str], ExpertWeights] = OrderedDict()
        self.num_bytes = 0
        self.num_reads = 0  # file reads (cache misses)

    def get(self, key: ExpertKey, device: torch.device) -> ExpertWeights:
        """The expert as the checkpoint holds it (in the compute dtype), on `device`."""
        slot = (key, str(device))
        cached = self._cache.get(slot)
        if cached is not None:
            self._cache.move_to_end(slot)
            return cached
        self.reader.is_checksum_verified, was = True, self.reader.is_checksum_verified  # never trust unchecked
        try:
            home = self.reader.read(key)
        finally:
            self.reader.is_checksum_verified = was
        self.num_reads += 1
        weights = ExpertWeights(home.gate_up.to(device), home.down.to(device))
        self._cache[slot] = weights
        self.num_bytes += weights.num_bytes
        while self.num_bytes > self.max_bytes and len(self._cache) > 1:
            _, dropped = self._cache.popitem(last=False)
            self.num_bytes -= dropped.num_bytes
        return weights

"""Marginal value per device byte of expert slots and KV blocks, for the joint controller.

- expert: misses avoided per step (decayed per-layer routing frequency of that expert) × its load time;
- KV block: one read per step while its request runs × its cheapest acceptable reload time (a quantized
  copy when its class may read one, else the full block); 0 for requests not running;
- kept prefix block: its reuse rate, (1 + adoptions) / (1 + steps idle), × the time to read it back from
  the tier it would go to (the disk on a CPU), so a hot prefix outranks a cold expert and a cold one leaves first.
Values are seconds saved per step per byte, so both sides compare in one unit.
"""

from __future__ import annotations

from collections.abc import Iterable

from fallbackgate.engine.controller import ControllerView
from fallbackgate.engine.experts.store import ExpertKey
from fallbackgate.engine.kv.prefix_cache import PrefixEntryInfo
from fallbackgate.engine.kv.store import KVBlockKey
from fallbackgate.engine.tags import Tier


class ValueModel:
    """Decayed routing frequencies and the value-per-byte estimates built on them."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self.freq: dict[ExpertKey, float] = {}

    def update(self, view: ControllerView) -> None:
        """Decay every frequency and count the last step's used and deferred experts once each."""
        used = set(view.used_expert_keys) | set(view.deferred_expert_keys)
        for key in list(self.freq):
            self.freq[key] *= self.decay
            if self.freq[key] < 1e-6 and key not in used:
                del self.freq[key]
        for key in used:
            self.freq[key] = self.freq.get(key, 0.0) + (1.0 - self.decay)

    def expected_misses(self, view: ControllerView) -> list[tuple[ExpertKey, float]]:
        """Non-resident experts with their probability of being needed next step."""
        return [(k, min(1.0, f)) for k, f in self.freq.items() if not view.is_expert_on_device(k)]

    def expert_value(self, key: ExpertKey, view: ControllerView) -> float:
        """Seconds saved per step per byte by keeping `key` on device."""
        freq = self.freq.get(key, 0.0)
        if not freq:
            return 0.0
        seconds = view.profile.transfer_s(view.bytes_per_expert, view.expert_home(key))
        return freq * seconds / view.bytes_per_expert

    def expert_values(self, keys: Iterable[ExpertKey], view: ControllerView) -> list[tuple[ExpertKey, float]]:
        """`expert_value` of each key, in order (the same floats; each home tier's load time computed once)."""
        num_bytes, seconds = view.bytes_per_expert, {}
        out = []
        for key in keys:
            freq = self.freq.get(key, 0.0)
            if not freq:
                out.append((key, 0.0))
                continue
            home = view.expert_home(key)
            if home not in seconds:
                seconds[home] = view.profile.transfer_s(num_bytes, home)
            out.append((key, freq * seconds[home] / num_bytes))
        return out

    def kv_value(self, key: KVBlockKey, view: ControllerView, running: set[str], reload_fraction: float = 1.0) -> float:
        """Seconds saved per step per byte by keeping KV block `key` on device (0 when its request is idle)."""
        if key[0] not in running:
            return 0.0
        num_bytes = view.bytes_per_kv_block
        seconds = view.profile.transfer_s(max(1, int(num_bytes * reload_fraction)), Tier.HOST)
        return seconds / num_bytes

    def prefix_value(self, entry: PrefixEntryInfo, view: ControllerView) -> float:
        """Seconds saved per step per byte by keeping a kept prefix block in the fast tier."""
        num_bytes = view.bytes_per_kv_block
        rate = min(1.0, (1 + entry.num_hits) / (1 + entry.idle_steps))
        seconds = view.profile.transfer_s(num_bytes, Tier.DISK if view.is_ram_tiered else Tier.HOST)
        return rate * seconds / num_bytes

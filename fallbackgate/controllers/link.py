"""One step's link time: transfers queue on the link of their tier pair and must arrive by the deadline."""

from __future__ import annotations

import dataclasses

from fallbackgate.engine.hardware import HardwareProfile
from fallbackgate.engine.tags import Tier


@dataclasses.dataclass
class LinkBudget:
    """Seconds left on each link in the current step: host->device (PCIe) and disk->host (NVMe).

    A disk-homed object uses both: its disk read and then its PCIe copy.
    """

    profile: HardwareProfile
    deadline_s: float = 0.0
    left_s: dict[Tier, float] = dataclasses.field(default_factory=dict)

    def reset(self, deadline_s: float) -> None:
        """Open a new step with `deadline_s` of link time on every link."""
        self.deadline_s = deadline_s
        self.left_s = {Tier.HOST: deadline_s, Tier.DISK: deadline_s}

    def legs(self, num_bytes: int, source: Tier | None) -> dict[Tier, float]:
        """Seconds `num_bytes` from `source` occupy each link (empty when nothing moves)."""
        if source is None or source is Tier.DEVICE or num_bytes <= 0:
            return {}
        p = self.profile
        pcie = p.link_latency_s + num_bytes / p.host_to_device_bytes_per_s
        if source is Tier.DISK:
            return {Tier.DISK: num_bytes / p.disk_to_host_bytes_per_s, Tier.HOST: pcie}
        return {Tier.HOST: pcie}

    def fits(self, num_bytes: int, source: Tier | None) -> bool:
        """Whether the transfer can still arrive before the deadline."""
        return all(self.left_s.get(t, 0.0) >= s for t, s in self.legs(num_bytes, source).items())

    def take(self, num_bytes: int, source: Tier | None) -> None:
        """Queue the transfer (the link may go negative: a slipped deadline)."""
        for tier, seconds in self.legs(num_bytes, source).items():
            self.left_s[tier] = self.left_s.get(tier, 0.0) - seconds

    def reserve_s(self, tier: Tier, seconds: float) -> None:
        """Hold `seconds` of one link back for later, higher-priority transfers."""
        self.left_s[tier] = self.left_s.get(tier, 0.0) - seconds

    def release_s(self, tier: Tier, seconds: float) -> None:
        """Give reserved seconds back."""
        self.left_s[tier] = self.left_s.get(tier, 0.0) + seconds

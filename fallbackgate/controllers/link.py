"""One step's link time: transfers queue on the link of their tier pair and must arrive by the deadline.

A disk read's time comes from the measured disk table (``HardwareProfile.disk``) at the queue depth it will
meet: the transfers already on the engine's I/O queue when the step starts, plus the step's disk reads
queued before it, up to the scheduler's transfers in flight at once.

On the RAM/disk layout (a CPU, ``TierLayout.RAM_DISK``) a disk read lands in RAM, where the expert computes:
it takes one leg, the disk's, and no host-to-device copy follows it.
"""

from __future__ import annotations

import dataclasses

from fallbackgate.engine.hardware import HardwareProfile
from fallbackgate.engine.io import IOSnapshot
from fallbackgate.engine.tags import Tier

_DEVICE, _HOST, _DISK = Tier.DEVICE, Tier.HOST, Tier.DISK  # bound once: the hot path skips enum lookups


@dataclasses.dataclass
class LinkBudget:
    """Seconds left on each link in the current step: host->device (PCIe) and disk->host (NVMe).

    A disk-homed object uses both: its disk read and then its PCIe copy; on the RAM/disk layout
    (`is_ram_tiered`) only its disk read.
    """

    profile: HardwareProfile
    deadline_s: float = 0.0
    left_s: dict[Tier, float] = dataclasses.field(default_factory=dict)
    disk_depth_at_start: int = 0  # transfers on the I/O queue when the step started
    disk_max_depth: int = 1  # transfers the I/O scheduler keeps in flight at once
    num_disk_queued: int = 0  # disk reads this step has queued so far
    is_ram_tiered: bool = False  # a CPU: a disk read lands in RAM directly, no host-to-device leg after it

    def reset(self, deadline_s: float, io: IOSnapshot | None = None, is_ram_tiered: bool = False) -> None:
        """Open a new step with `deadline_s` of link time on every link, behind the I/O queue `io`, on the
        RAM/disk layout when `is_ram_tiered`."""
        self.deadline_s = deadline_s
        self.is_ram_tiered = is_ram_tiered
        self.left_s = {Tier.HOST: deadline_s, Tier.DISK: deadline_s}
        self.disk_depth_at_start = io.depth if io is not None else 0
        self.disk_max_depth = max(1, io.num_workers) if io is not None else 1
        self.num_disk_queued = 0

    @property
    def disk_queue_depth(self) -> int:
        """The queue depth the next disk read meets (itself included)."""
        return min(self.disk_max_depth, self.disk_depth_at_start + self.num_disk_queued + 1)

    def legs(self, num_bytes: int, source: Tier | None) -> dict[Tier, float]:
        """Seconds `num_bytes` from `source` occupy each link (empty when nothing moves)."""
        if source is None or source is _DEVICE or num_bytes <= 0:
            return {}
        p = self.profile
        pcie = p.link_latency_s + num_bytes / p.host_to_device_bytes_per_s
        if source is _DISK:
            disk_s = p.disk_read_busy_s(num_bytes, self.disk_queue_depth)
            return {_DISK: disk_s} if self.is_ram_tiered else {_DISK: disk_s, _HOST: pcie}
        return {_HOST: pcie}

    def disk_arrival_s(self, num_bytes: int) -> float:
        """Predicted seconds from submission to arrival of the next disk read of `num_bytes`."""
        return self.profile.disk_read_s(num_bytes, self.disk_queue_depth)

    def fits(self, num_bytes: int, source: Tier | None) -> bool:
        """Whether the transfer can still arrive before the deadline."""
        if source is None or source is _DEVICE or num_bytes <= 0:
            return True  # nothing moves (`legs` is empty)
        p, left = self.profile, self.left_s
        if source is _DISK:
            if left.get(_DISK, 0.0) < p.disk_read_busy_s(num_bytes, self.disk_queue_depth):
                return False
            if self.is_ram_tiered:
                return True
        return left.get(_HOST, 0.0) >= p.link_latency_s + num_bytes / p.host_to_device_bytes_per_s

    def take(self, num_bytes: int, source: Tier | None) -> None:
        """Queue the transfer (the link may go negative: a slipped deadline)."""
        if source is None or source is _DEVICE or num_bytes <= 0:
            return  # nothing moves (`legs` is empty)
        p, left = self.profile, self.left_s
        if source is _DISK:
            left[_DISK] = left.get(_DISK, 0.0) - p.disk_read_busy_s(num_bytes, self.disk_queue_depth)
            self.num_disk_queued += 1
            if self.is_ram_tiered:
                return
        left[_HOST] = left.get(_HOST, 0.0) - (p.link_latency_s + num_bytes / p.host_to_device_bytes_per_s)

    def fits_legs(self, legs: dict[Tier, float]) -> bool:
        """Whether every leg (as :meth:`legs` gives them) still fits its link before the deadline."""
        return all(self.left_s.get(tier, 0.0) >= seconds for tier, seconds in legs.items())

    def take_legs(self, legs: dict[Tier, float]) -> None:
        """Queue a transfer given as its legs (a disk leg counts as one more disk read queued)."""
        for tier, seconds in legs.items():
            self.left_s[tier] = self.left_s.get(tier, 0.0) - seconds
        if _DISK in legs:
            self.num_disk_queued += 1

    def used_s(self, source: Tier | None) -> float:
        """Link seconds queued so far this step on the links `source` uses (the latest of them): when a
        transfer queued now would start arriving."""
        deadline, left = self.deadline_s, self.left_s
        host = deadline - left.get(_HOST, deadline)
        if source is not _DISK:
            return host
        disk = deadline - left.get(_DISK, deadline)
        return disk if self.is_ram_tiered else max(disk, host)

    def reserve_s(self, tier: Tier, seconds: float) -> None:
        """Hold `seconds` of one link back for later, higher-priority transfers."""
        self.left_s[tier] = self.left_s.get(tier, 0.0) - seconds

    def release_s(self, tier: Tier, seconds: float) -> None:
        """Give reserved seconds back."""
        self.left_s[tier] = self.left_s.get(tier, 0.0) + seconds

    def late_text(self, what: str, num_bytes: int, source: Tier | None) -> str:
        """Why a transfer misses the deadline, on the link it is short of: '<what> late (3.1 ms of disk link,
        0.4 ms left)'; the tightest of its links when none is short."""
        legs, left = self.legs(num_bytes, source), self.left_s
        if not legs:
            return f"{what} late (nothing to move)"
        tier = min(legs, key=lambda t: left.get(t, 0.0) - legs[t])
        link = "disk" if tier is _DISK else "host-to-device"
        left_ms = 1e3 * max(0.0, left.get(tier, 0.0))
        return f"{what} late ({1e3 * legs[tier]:.3f} ms of {link} link, {left_ms:.3f} ms left)"

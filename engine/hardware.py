"""Hardware profiles and the cost model that turns work and bytes into modeled seconds."""

from __future__ import annotations

import dataclasses

from fallbackgate.engine.tags import Tier


@dataclasses.dataclass(slots=True, frozen=True)
class HardwareProfile:
    """Link bandwidths and compute rates of one machine (bytes/s and FLOP/s)."""

    name: str  # profile name shown in reports
    host_to_device_bytes_per_s: float  # host -> device link (PCIe on a GPU box)
    device_to_host_bytes_per_s: float  # device -> host link
    disk_to_host_bytes_per_s: float  # NVMe/disk read into host memory
    host_to_disk_bytes_per_s: float  # writes to the spill directory
    device_flops: float  # sustained device FLOP/s for the model's matmuls
    cpu_expert_flops: float  # sustained CPU FLOP/s for cpu_execute experts
    link_latency_s: float = 10e-6  # fixed cost per transfer

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, float) and not value > 0 and field.name != "link_latency_s":
                raise ValueError(f"hardware profile field {field.name} must be > 0, got {value}")

    def transfer_s(self, num_bytes: int, source: Tier, target: Tier = Tier.DEVICE) -> float:
        """Modeled seconds to move `num_bytes` from `source` to `target` (disk->device goes via host)."""
        if num_bytes <= 0 or source is target:
            return 0.0
        seconds = self.link_latency_s
        if source is Tier.DISK:
            seconds += num_bytes / self.disk_to_host_bytes_per_s
            if target is Tier.DEVICE:
                seconds += num_bytes / self.host_to_device_bytes_per_s
        elif source is Tier.HOST and target is Tier.DEVICE:
            seconds += num_bytes / self.host_to_device_bytes_per_s
        elif source is Tier.DEVICE and target is Tier.HOST:
            seconds += num_bytes / self.device_to_host_bytes_per_s
        elif target is Tier.DISK:
            seconds += num_bytes / self.host_to_disk_bytes_per_s
        return seconds

    def device_compute_s(self, flops: float) -> float:
        """Modeled seconds for `flops` of device work."""
        return flops / self.device_flops

    def cpu_compute_s(self, flops: float) -> float:
        """Modeled seconds for `flops` of CPU expert work."""
        return flops / self.cpu_expert_flops


CPU_BOX = HardwareProfile(
    name="cpu-box",  # this 2-core machine: the "device" is a capacity-limited pool in host memory
    host_to_device_bytes_per_s=8e9,
    device_to_host_bytes_per_s=8e9,
    disk_to_host_bytes_per_s=1.5e9,
    host_to_disk_bytes_per_s=1.0e9,
    device_flops=40e9,
    cpu_expert_flops=40e9,
    link_latency_s=2e-6,
)

PCIE4_GPU_NVME = HardwareProfile(
    name="pcie4-gpu-nvme",  # one GPU on PCIe 4.0 x16, a fast NVMe drive, a 32-core host
    host_to_device_bytes_per_s=25e9,
    device_to_host_bytes_per_s=25e9,
    disk_to_host_bytes_per_s=6.5e9,
    host_to_disk_bytes_per_s=4.0e9,
    device_flops=150e12,
    cpu_expert_flops=1.5e12,
    link_latency_s=10e-6,
)

PROFILES: dict[str, HardwareProfile] = {p.name: p for p in (CPU_BOX, PCIE4_GPU_NVME)}


def get_profile(name: str) -> HardwareProfile:
    """Look up a shipped profile by name."""
    if name not in PROFILES:
        raise ValueError(f"unknown hardware profile {name!r}; shipped profiles: {sorted(PROFILES)}")
    return PROFILES[name]

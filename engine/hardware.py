"""Hardware profiles: link bandwidths and compute rates of one machine, and the seconds they predict.

A profile is either measured on this machine (``fallbackgate profile``; ``is_measured``) or a shipped
what-if (``cpu-box``, ``pcie4-gpu-nvme``). Controllers predict with it; times shown to users are wall clock
unless labelled modeled.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fallbackgate.engine.disk_model import DiskTable
from fallbackgate.engine.tags import Tier


@dataclasses.dataclass(slots=True, frozen=True)
class ExpertCurve:
    """Measured expert-call time: a fixed cost plus weight bytes × seconds per byte at a token count
    (piecewise linear between the measured counts, linear beyond the last)."""

    call_s: float  # the smallest measured call
    num_tokens: tuple[int, ...]  # measured token counts, ascending
    s_per_byte: tuple[float, ...]  # seconds per weight byte beyond the fixed cost, at each count

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_tokens", tuple(int(n) for n in self.num_tokens))
        object.__setattr__(self, "s_per_byte", tuple(float(r) for r in self.s_per_byte))
        if not self.num_tokens or len(self.num_tokens) != len(self.s_per_byte):
            raise ValueError("expert curve needs one seconds-per-byte figure per token count")

    def predict_s(self, num_tokens: int, num_weight_bytes: int) -> float:
        """Seconds of one call over `num_tokens` tokens with `num_weight_bytes` of weights."""
        xs, ys = self.num_tokens, self.s_per_byte
        if num_tokens <= xs[0] or len(xs) == 1:
            rate = ys[0]
        else:
            i = next((j for j in range(1, len(xs)) if num_tokens <= xs[j]), len(xs) - 1)
            rate = ys[i - 1] + (ys[i] - ys[i - 1]) * (num_tokens - xs[i - 1]) / (xs[i] - xs[i - 1])
        return self.call_s + max(rate, 0.0) * num_weight_bytes


_MAY_BE_ZERO = frozenset(
    {
        "link_latency_s",
        "device_bytes_per_s",
        "cpu_expert_bytes_per_s",
        "expert_call_s",
        "layer_overhead_s",
        "step_overhead_s",
        "request_overhead_s",
    }
)


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
    device_bytes_per_s: float = 0.0  # weight bytes a device matmul streams per second (0: compute-bound only)
    cpu_expert_bytes_per_s: float = 0.0  # weight bytes a CPU expert streams per second (0: compute-bound only)
    expert_call_s: float = 0.0  # fixed cost of one expert call (kernel launches, Python)
    layer_overhead_s: float = 0.0  # fixed cost of one decoder layer's dense part per step
    step_overhead_s: float = 0.0  # the engine's own fixed cost per step (scheduling, events), beyond the model's
    request_overhead_s: float = 0.0  # the engine's cost per request in a step (attention call, sampling)
    is_measured: bool = False  # measured on this machine by `fallbackgate profile`, not a shipped what-if
    measured_at: str = ""  # ISO time of the measurement
    machine: str = ""  # the machine key the measurement belongs to
    expert_curves: dict[str, ExpertCurve] = dataclasses.field(default_factory=dict)
    # per "cpu/<dtype>" or "device/<dtype>": measured expert-call time by token count
    disk: DiskTable | None = None  # the disk's latency and bandwidth by size and queue depth (None: profiles
    # measured before the table existed, and the what-ifs: the scalar disk rates stand in)
    engine_io: dict[str, Any] | None = None  # a miss through the engine's I/O path by size and depth
    # (`fallbackgate.profiling.engine_io`: wait, service, wakeup, checksum, copy; None: not measured)

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "expert_curves":
                curves = {k: v if isinstance(v, ExpertCurve) else ExpertCurve(**v) for k, v in value.items()}
                object.__setattr__(self, "expert_curves", curves)
            elif field.name == "disk":
                if isinstance(value, dict):
                    object.__setattr__(self, "disk", DiskTable(**value))
            elif field.name in _MAY_BE_ZERO:
                if not value >= 0:
                    raise ValueError(f"hardware profile field {field.name} must be >= 0, got {value}")
            elif isinstance(value, float) and not value > 0:
                raise ValueError(f"hardware profile field {field.name} must be > 0, got {value}")

    def transfer_s(self, num_bytes: int, source: Tier, target: Tier = Tier.DEVICE) -> float:
        """Modeled seconds to move `num_bytes` from `source` to `target` (disk->device goes via host)."""
        if num_bytes <= 0 or source is target:
            return 0.0
        seconds = self.link_latency_s
        if source is Tier.DISK:
            seconds += self.disk_read_s(num_bytes)
            if target is Tier.DEVICE:
                seconds += num_bytes / self.host_to_device_bytes_per_s
        elif source is Tier.HOST and target is Tier.DEVICE:
            seconds += num_bytes / self.host_to_device_bytes_per_s
        elif source is Tier.DEVICE and target is Tier.HOST:
            seconds += num_bytes / self.device_to_host_bytes_per_s
        elif target is Tier.DISK:
            rate = self.host_to_disk_bytes_per_s
            seconds += self.disk.write_s(num_bytes) if self.disk is not None else num_bytes / rate
        return seconds

    def disk_read_s(self, num_bytes: int, queue_depth: int = 1) -> float:
        """Predicted seconds from submission to arrival of one disk read of `num_bytes` that finds
        `queue_depth` transfers (itself included) on the disk: the measured table, else the scalar rate."""
        if self.disk is not None:
            return self.disk.read_s(num_bytes, queue_depth)
        return max(1, queue_depth) * num_bytes / self.disk_to_host_bytes_per_s

    def disk_read_busy_s(self, num_bytes: int, queue_depth: int = 1) -> float:
        """Seconds of disk time one read of `num_bytes` takes among `queue_depth` sharing the disk (what
        queued reads add up to): its bytes over the measured rate at that depth, else the scalar rate."""
        if self.disk is not None:
            return self.disk.read_busy_s(num_bytes, queue_depth)
        return num_bytes / self.disk_to_host_bytes_per_s

    def device_compute_s(self, flops: float) -> float:
        """Modeled seconds for `flops` of device work."""
        return flops / self.device_flops

    def expert_s(self, num_tokens: int, num_weight_bytes: int, num_params: int, on_cpu: bool, dtype: str = "") -> float:
        """Predicted seconds of one expert call over `num_tokens` tokens: the measured curve of the device
        (or CPU) and dtype where the profile has one, else a roofline of the scalar rates (a fixed cost plus
        the slower of streaming the weights and 2 FLOPs per parameter per token)."""
        curve = self.expert_curves.get(f"{'cpu' if on_cpu else 'device'}/{dtype}")
        if curve is not None:
            return curve.predict_s(num_tokens, num_weight_bytes)
        rate, bandwidth = (
            (self.cpu_expert_flops, self.cpu_expert_bytes_per_s)
            if on_cpu
            else (self.device_flops, self.device_bytes_per_s)
        )
        streaming_s = num_weight_bytes / bandwidth if bandwidth > 0 else 0.0
        return self.expert_call_s + max(streaming_s, 2.0 * num_params * num_tokens / rate)

    def dense_step_s(self, num_layers: int, dense_flops: float) -> float:
        """Predicted seconds of a step's dense part (attention, norms, router, head) over `num_layers`."""
        return num_layers * self.layer_overhead_s + dense_flops / self.device_flops


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


_RECORDS: dict[int, tuple[HardwareProfile, dict[str, Any]]] = {}  # id -> (the profile, kept alive; its record)
_MAX_RECORDS = 16


def profile_record(profile: HardwareProfile) -> dict[str, Any]:
    """``dataclasses.asdict(profile)`` as runs and traces record it, built once per profile (a measured one's
    curves and disk table make it thousands of calls, per run). Shared: callers must not change it."""
    kept = _RECORDS.get(id(profile))
    if kept is not None and kept[0] is profile:
        return kept[1]
    if len(_RECORDS) >= _MAX_RECORDS:
        _RECORDS.clear()
    record = dataclasses.asdict(profile)
    _RECORDS[id(profile)] = (profile, record)
    return record

"""Device models a trace's misses are priced on: the measured one (fitted from the trace's own I/O rows, or its
profile) and two labelled what-ifs. A model prices one step's misses as
``ceil(num_misses / queue_depth) × latency + bytes / bandwidth``: reads in flight overlap their latency, not
their bytes (one link)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from fallbackgate.tracing.reader import Trace
from fallbackgate.tracing.schema import TraceTable


@dataclasses.dataclass(slots=True, frozen=True)
class DeviceModel:
    """Where misses are served from, and what a read costs there."""

    name: str  # e.g. "measured", "nvme-pcie4 (what-if)"
    latency_ns: float  # fixed cost of one read
    bandwidth_bytes_per_s: float  # bytes per second over the link
    queue_depth: int = 1  # reads whose latency overlaps
    is_what_if: bool = False  # assumed numbers, not measured on this machine
    source: str = ""  # where the numbers come from

    def read_ns(self, num_bytes: Any) -> Any:
        """Time of single reads of ``num_bytes`` each."""
        return self.latency_ns + np.asarray(num_bytes, dtype=np.float64) * 1e9 / self.bandwidth_bytes_per_s

    def stall_ns(self, num_misses: Any, num_bytes: Any) -> np.ndarray:
        """Stall of steps with ``num_misses`` reads totalling ``num_bytes`` (arrays, one entry per step)."""
        misses = np.asarray(num_misses, dtype=np.float64)
        rounds = np.ceil(misses / max(self.queue_depth, 1))
        return rounds * self.latency_ns + np.asarray(num_bytes, dtype=np.float64) * 1e9 / self.bandwidth_bytes_per_s


NVME_PCIE4 = DeviceModel(
    "nvme-pcie4 (what-if)", 80_000, 6.5e9, 32, True,
    "assumed: a PCIe 4 x4 NVMe SSD, ~80 us read latency at QD1, ~6.5 GB/s sequential read, QD 32",
)  # fmt: skip
HBM_PCIE5 = DeviceModel(
    "hbm-pcie5 (what-if)", 5_000, 50e9, 2, True,
    "assumed: GPU HBM as the fast tier, misses from host DRAM over PCIe 5 x16 (~50 GB/s effective, ~5 us per "
    "copy, 2 copy engines)",
)  # fmt: skip
WHAT_IFS: tuple[DeviceModel, ...] = (NVME_PCIE4, HBM_PCIE5)


def fit_measured(trace: Trace) -> DeviceModel | None:
    """Latency and bandwidth fitted (least squares, duration = latency + bytes / bandwidth) to the trace's
    reads; None when the reads are too few or all one size and the profile has no numbers either."""
    io = trace.tables[TraceTable.IO]
    if io.num_rows:
        is_read = np.asarray(io.column("op").to_pandas() == "read")
        sizes = io.column("bytes").to_numpy()[is_read].astype(np.float64)
        durations = (io.column("end_ns").to_numpy() - io.column("start_ns").to_numpy())[is_read].astype(np.float64)
        depth = io.column("queue_depth").to_numpy()[is_read]
        if sizes.size >= 3 and np.unique(sizes).size >= 2:
            slope, intercept = np.polyfit(sizes, durations, 1)
            if slope > 0:
                return DeviceModel(
                    "measured", max(float(intercept), 0.0), 1e9 / float(slope), int(max(depth.max(), 1)), False,
                    f"fitted to the trace's {sizes.size} reads (duration = latency + bytes / bandwidth)",
                )  # fmt: skip
    profile = trace.metadata.get("profile") or {}
    if "latency_ns" in profile and "bandwidth_bytes_per_s" in profile:
        return DeviceModel(
            "measured", float(profile["latency_ns"]), float(profile["bandwidth_bytes_per_s"]),
            int(profile.get("queue_depth", 1)), False, "the trace's recorded profile",
        )  # fmt: skip
    return None


def device_models(trace: Trace) -> list[DeviceModel]:
    """The measured model followed by the what-ifs: fitted to the trace's reads (or the numbers its profile
    states) when they allow it, else this machine's miss as the trace's recorded ``fallbackgate profile``
    measured it through the engine's I/O path (:func:`fit_profile`, named ``profile``; ``profile-disk``, the
    pure disk, where that profile has no engine I/O points), since a recording whose reads are all one
    expert's size cannot be fitted; none when neither is there."""
    measured = fit_measured(trace) or fit_profile(trace)
    return ([measured] if measured else []) + list(WHAT_IFS)


def fit_waits(trace: Trace) -> DeviceModel | None:
    """The device as the recorded steps waited on it: latency and bandwidth fitted to every demand miss's wait
    (an access row with bytes and a wait: the engine's whole fetch, queueing, scheduling on a loaded CPU and
    the copy into its slot included, not only the disk's service time). Queue depth 1: the waits already
    are what one miss cost at the depth the engine ran. With one object size the bandwidth is the profile's
    disk curve's (else the waits' own bytes per second) and the rest of the mean wait is latency."""
    sizes, waits = [], []
    for table in (TraceTable.EXPERT_ACCESS, TraceTable.KV_ACCESS):
        frame = trace.tables[table]
        if frame.num_rows:
            num_bytes, ns = frame.column("bytes").to_numpy(), frame.column("ns").to_numpy()
            keep = (num_bytes > 0) & (ns > 0)
            sizes.append(num_bytes[keep].astype(np.float64))
            waits.append(ns[keep].astype(np.float64))
    size, wait = (np.concatenate(sizes), np.concatenate(waits)) if sizes else (np.zeros(0), np.zeros(0))
    if size.size < 3:
        return None
    source = f"fitted to the {size.size} demand waits the trace's steps recorded (whole fetch, queueing included)"
    if np.unique(size).size >= 2:
        slope, intercept = np.polyfit(size, wait, 1)
        if slope > 0 and intercept >= 0:
            return DeviceModel("waits", float(intercept), 1e9 / float(slope), 1, False, source)
    profile = fit_profile_disk(trace)
    bandwidth = profile.bandwidth_bytes_per_s if profile else float(size.sum() / (wait.sum() / 1e9))
    latency = max(float(wait.mean() - size.mean() * 1e9 / bandwidth), 0.0)
    return DeviceModel("waits", latency, bandwidth, 1, False, source + "; bandwidth " + (
        "of the profile's disk curve" if profile else "of the waits themselves"))  # fmt: skip


def fit_profile(trace: Trace) -> DeviceModel | None:
    """A miss as ``fallbackgate profile`` measured it through the engine's own I/O path (the trace's recorded
    profile, ``engine_io``): at queue depth 1, the mean of submission until the waiter woke, per read size,
    latency and bandwidth fitted to those (least relative squares); then, when the profile measured misses
    through the real store (``engine_io.misses``), the engine's own time per miss beyond its read (evict,
    place, checksum, copy) is added to the latency; without it the points' checksum and copy into a slot are
    fitted instead. Profiles without the table fall back to the pure disk (:func:`fit_profile_disk`)."""
    engine_io = (trace.metadata.get("profile") or {}).get("engine_io") or {}
    reads = [p for p in engine_io.get("points") or [] if p.get("queue_depth") == 1 and p.get("mean_total_s")]
    if len({p["num_bytes"] for p in reads}) < 2:
        return fit_profile_disk(trace)
    misses = engine_io.get("misses") or {}
    if misses.get("overhead_s") is not None:  # the engine's own work per miss, checksum and copy included
        seconds = [max(p["mean_total_s"] - p["checksum_s"] - p["copy_s"], 1e-9) for p in reads]
    else:
        seconds = [p["mean_total_s"] for p in reads]
    fitted = _fit_relative([p["num_bytes"] for p in reads], seconds)
    if fitted is None:
        return fit_profile_disk(trace)
    source = (
        f"fitted to the recorded `fallbackgate profile` engine I/O path at queue depth 1 ({len(reads)} sizes: "
        "shared scheduler wait and wakeup"
    )
    if misses.get("overhead_s") is None:
        return DeviceModel("profile", fitted[0], fitted[1], 1, False, source + ", xxh3 checksum, copy into a slot)")
    overhead_ns = 1e9 * float(misses["overhead_s"])
    return DeviceModel(
        "profile", fitted[0] + overhead_ns, fitted[1], 1, False,
        source + f"), plus the engine's own {overhead_ns / 1e6:.3f} ms per miss beyond its read (evict, place, "
        f"checksum, copy; {misses.get('num_misses')} misses of the bundled model through the real store)",
    )  # fmt: skip


def fit_profile_disk(trace: Trace) -> DeviceModel | None:
    """The disk as ``fallbackgate profile`` measured it (the trace's recorded profile): latency and bandwidth
    fitted to its queue-depth-1 read points (mean latency of a read of each size; least relative squares, so
    small reads count as much as 16 MiB ones); None without them."""
    points = ((trace.metadata.get("profile") or {}).get("disk") or {}).get("points") or []
    reads = [p for p in points if p.get("op") == "read" and p.get("queue_depth") == 1 and p.get("latency_s")]
    if len({p["num_bytes"] for p in reads}) < 2:
        return None
    fitted = _fit_relative([p["num_bytes"] for p in reads], [p["latency_s"] for p in reads])
    if fitted is None:
        return None
    return DeviceModel(
        "profile-disk", fitted[0], fitted[1], 1, False,
        f"fitted to the recorded `fallbackgate profile` disk reads at queue depth 1 ({len(reads)} sizes)",
    )  # fmt: skip


def _fit_relative(sizes: list[int], seconds: list[float]) -> tuple[float, float] | None:
    """(latency ns, bandwidth bytes/s) of time = latency + bytes / bandwidth, weighted by 1 / time (relative
    errors: every size counts); None when the slope is not positive."""
    size = np.array(sizes, dtype=np.float64)
    ns = np.array(seconds, dtype=np.float64) * 1e9
    slope, intercept = np.polyfit(size, ns, 1, w=1 / ns)
    if slope <= 0:
        return None
    return max(float(intercept), 0.0), 1e9 / float(slope)


def simulation_devices(trace: Trace) -> list[DeviceModel]:
    """What ``trace simulate`` offers: the measured model, the trace's own waits, the profile's engine I/O
    path, the profile's pure disk, the what-ifs (those the trace allows)."""
    fitted = [fit_measured(trace), fit_waits(trace), fit_profile(trace)]
    if fitted[2] is not None and fitted[2].name != "profile-disk":
        fitted.append(fit_profile_disk(trace))
    return [d for d in fitted if d is not None] + list(WHAT_IFS)

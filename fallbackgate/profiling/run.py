"""One full measurement of this machine, with a progress bar: links, expert rooflines, the decode step."""

from __future__ import annotations

import dataclasses
import pathlib
import tempfile
from typing import Any

import torch
from tqdm import tqdm

from fallbackgate.engine.disk_model import DiskTable
from fallbackgate.engine.hardware import HardwareProfile
from fallbackgate.profiling.disk import disk_grid, measure_disk_table
from fallbackgate.profiling.engine_io import measure_engine_io
from fallbackgate.profiling.fit import build_profile, curve_errors, fit_curve, fit_errors, fit_roofline, group_timings
from fallbackgate.profiling.machine import machine_key
from fallbackgate.profiling.measure import (
    EXPERT_SHAPES,
    MIB,
    ExpertTiming,
    measure_copies,
    measure_decode_step,
    measure_disk,
    measure_engine_steps,
    measure_experts,
)

DISK_BYTES = 256 * MIB
COPY_BYTES = 128 * MIB


@dataclasses.dataclass(slots=True)
class Measured:
    """Everything one pass over the machine measured, before any fit."""

    disk_dir: pathlib.Path  # the file system measured
    write_rate: float  # bytes/s, host to disk
    read_rate: float  # bytes/s, disk to host
    disk_table: DiskTable  # read latency and rate by size and queue depth
    engine_io: dict[str, Any]  # the engine's own I/O paths
    to_device: float  # bytes/s, host to device (host to host on a CPU)
    to_host: float  # bytes/s, device to host
    cpu_timings: list[ExpertTiming]  # expert timings on the CPU, the profile's dtype then float32
    device_timings: list[ExpertTiming]  # the same on the accelerator (empty on a CPU)
    decode_s: float  # one decode step of the bundled model
    num_layers: int
    num_moe_layers: int
    engine_steps: tuple[float, float, int, int, int]  # the engine's decode step at batch 1 and 6, and its shape


def measure_machine(
    disk_dir: pathlib.Path | None = None,
    dtype: torch.dtype = torch.bfloat16,
    quiet: bool = False,
    is_quick: bool = False,
) -> tuple[HardwareProfile, dict[str, Any]]:
    """Measure every rate of the profile; returns it with the raw measurements (and the fit's errors).
    `disk_dir` is the spill directory whose file system is measured (default: the temporary directory, where
    the engine spills when given none); `is_quick` measures the disk on the smaller grid."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    measured = measure_parts(device, disk_dir or pathlib.Path(tempfile.gettempdir()), dtype, quiet, is_quick)
    return fit_measured(measured, device, dtype)


def measure_parts(
    device: torch.device, disk_dir: pathlib.Path, dtype: torch.dtype, quiet: bool, is_quick: bool
) -> Measured:
    """The six measurements, each a step of one progress bar."""
    bar = tqdm(total=6, desc="profile", disable=quiet, unit="part")
    write_rate, read_rate = measure_disk(disk_dir, DISK_BYTES)
    bar.update()
    disk_table = measure_disk_table(disk_dir, *disk_grid(is_quick))
    engine_io = measure_engine_io(disk_dir)
    bar.update()
    to_device, to_host = measure_copies(device, COPY_BYTES)
    bar.update()
    cpu_timings = measure_experts(torch.device("cpu"), dtype)
    cpu_timings += measure_experts(torch.device("cpu"), torch.float32)
    bar.update()
    device_timings = []
    if device.type != "cpu":
        device_timings = measure_experts(device, dtype) + measure_experts(device, torch.float32)
    bar.update()
    decode_s, num_layers, num_moe_layers = measure_decode_step(device)
    engine_steps = measure_engine_steps(device)
    bar.update()
    bar.close()
    return Measured(
        disk_dir,
        write_rate,
        read_rate,
        disk_table,
        engine_io,
        to_device,
        to_host,
        cpu_timings,
        device_timings,
        decode_s,
        num_layers,
        num_moe_layers,
        engine_steps,
    )


def fit_measured(m: Measured, device: torch.device, dtype: torch.dtype) -> tuple[HardwareProfile, dict[str, Any]]:
    """The profile fitted to the measurements, and the raw measurements with the fits' errors."""
    timings = m.cpu_timings + m.device_timings
    groups = group_timings(timings, device.type)
    fits = {key: fit_roofline(group) for key, group in groups.items()}
    curves = {key: fit_curve(group) for key, group in groups.items()}
    bundled = [
        t
        for t in m.device_timings or m.cpu_timings
        if (t.hidden, t.intermediate) == EXPERT_SHAPES[0] and t.num_tokens == 1 and t.dtype == "float32"
    ]
    links = {
        "host_to_device_bytes_per_s": m.to_device,
        "device_to_host_bytes_per_s": m.to_host,
        "disk_to_host_bytes_per_s": m.read_rate,
        "host_to_disk_bytes_per_s": m.write_rate,
    }
    name = str(dtype).removeprefix("torch.")
    profile = build_profile(
        machine_key(),
        links,
        fits,
        curves,
        name,
        m.decode_s,
        m.num_layers,
        m.num_moe_layers,
        bundled[0].seconds,
        m.engine_steps,
        m.disk_table,
    )
    profile = dataclasses.replace(profile, engine_io=m.engine_io)
    errors = {
        key: {"roofline": fit_errors(fits[key], group), "curve": curve_errors(curves[key], group)}
        for key, group in groups.items()
    }
    raw = {
        "device": device.type,
        "disk_dir": str(m.disk_dir),
        "disk_bytes": DISK_BYTES,
        "copy_bytes": COPY_BYTES,
        "decode_step_s": m.decode_s,
        "engine_decode_step_s": {"batch_1": m.engine_steps[0], "batch_6": m.engine_steps[1]},
        "num_layers": m.num_layers,
        "expert_timings": [dataclasses.asdict(t) for t in timings],
        "fit_errors": errors,
    }
    return profile, raw

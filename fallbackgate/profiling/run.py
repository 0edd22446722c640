"""One full measurement of this machine, with a progress bar: links, expert rooflines, the decode step."""

from __future__ import annotations

import dataclasses
import pathlib
import tempfile
from typing import Any

import torch
from tqdm import tqdm

from fallbackgate.engine.hardware import HardwareProfile
from fallbackgate.profiling.disk import disk_grid, measure_disk_table
from fallbackgate.profiling.engine_io import measure_engine_io
from fallbackgate.profiling.fit import build_profile, curve_errors, fit_curve, fit_errors, fit_roofline, group_timings
from fallbackgate.profiling.machine import machine_key
from fallbackgate.profiling.measure import (
    EXPERT_SHAPES,
    MIB,
    measure_copies,
    measure_decode_step,
    measure_disk,
    measure_engine_steps,
    measure_experts,
)

DISK_BYTES = 256 * MIB
COPY_BYTES = 128 * MIB


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
    bar = tqdm(total=6, desc="profile", disable=quiet, unit="part")
    disk_dir = disk_dir or pathlib.Path(tempfile.gettempdir())
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
    timings = cpu_timings + device_timings
    groups = group_timings(timings, device.type)
    fits = {key: fit_roofline(group) for key, group in groups.items()}
    curves = {key: fit_curve(group) for key, group in groups.items()}
    bundled = [
        t
        for t in device_timings or cpu_timings
        if (t.hidden, t.intermediate) == EXPERT_SHAPES[0] and t.num_tokens == 1 and t.dtype == "float32"
    ]
    links = {
        "host_to_device_bytes_per_s": to_device,
        "device_to_host_bytes_per_s": to_host,
        "disk_to_host_bytes_per_s": read_rate,
        "host_to_disk_bytes_per_s": write_rate,
    }
    name = str(dtype).removeprefix("torch.")
    profile = build_profile(
        machine_key(),
        links,
        fits,
        curves,
        name,
        decode_s,
        num_layers,
        num_moe_layers,
        bundled[0].seconds,
        engine_steps,
        disk_table,
    )
    profile = dataclasses.replace(profile, engine_io=engine_io)
    errors = {
        key: {"roofline": fit_errors(fits[key], group), "curve": curve_errors(curves[key], group)}
        for key, group in groups.items()
    }
    raw = {
        "device": device.type,
        "disk_dir": str(disk_dir),
        "disk_bytes": DISK_BYTES,
        "copy_bytes": COPY_BYTES,
        "decode_step_s": decode_s,
        "engine_decode_step_s": {"batch_1": engine_steps[0], "batch_6": engine_steps[1]},
        "num_layers": num_layers,
        "expert_timings": [dataclasses.asdict(t) for t in timings],
        "fit_errors": errors,
    }
    return profile, raw

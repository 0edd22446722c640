"""Which machine a measured profile belongs to."""

from __future__ import annotations

import os
import pathlib
import platform

import torch


def machine_key() -> str:
    """What a measurement belongs to: host, CPU model and count, accelerator and torch version."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    accel = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no-accelerator"
    return f"{platform.node()}|{cpu}|{os.cpu_count()} cpus|{accel}|torch {torch.__version__}"

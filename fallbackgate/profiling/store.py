"""The measured profile of this machine: measured once, cached per machine, and resolved by name.

``measured`` (the default everywhere) is this machine's cached measurement, measured on first use;
``$FALLBACKGATE_PROFILE`` may name a profile JSON file to use instead (tests pin one so their decisions do
not depend on the machine). ``cpu-box`` and ``pcie4-gpu-nvme`` are shipped what-ifs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import sys
import tempfile
from typing import Any

from fallbackgate.engine.hardware import HardwareProfile, get_profile
from fallbackgate.profiling.machine import machine_key
from fallbackgate.profiling.names import MEASURED

ENV_PROFILE = "FALLBACKGATE_PROFILE"  # a profile JSON file that stands in for the measurement
ENV_CACHE = "FALLBACKGATE_CACHE_DIR"


class ProfileFileError(ValueError):
    """A profile JSON file that cannot be read; the message names the file."""


def cache_dir() -> pathlib.Path:
    """fallbackgate's cache directory ($FALLBACKGATE_CACHE_DIR, else ~/.cache/fallbackgate)."""
    return pathlib.Path(os.environ.get(ENV_CACHE) or pathlib.Path.home() / ".cache" / "fallbackgate")


def cache_path() -> pathlib.Path:
    """This machine's cached profile file."""
    root = cache_dir()
    digest = hashlib.sha1(machine_key().encode()).hexdigest()[:12]
    return root / "profiles" / f"{digest}.json"


def save_profile(path: pathlib.Path, profile: HardwareProfile, raw: dict[str, Any]) -> None:
    """Write the profile and its raw measurements atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"profile": dataclasses.asdict(profile), "raw": raw}, indent=2) + "\n")
    tmp.replace(path)


def load_profile_file(path: pathlib.Path) -> HardwareProfile:
    """A profile from a JSON file written by ``fallbackgate profile`` (or a bare profile mapping)."""
    try:
        data = json.loads(path.read_text())
        fields = data.get("profile", data)
        return HardwareProfile(**fields)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError, TypeError, ValueError) as exc:
        raise ProfileFileError(f"{path}: not a fallbackgate hardware profile ({exc})") from None


def measured_profile(
    refresh: bool = False, quiet: bool = False, disk_dir: pathlib.Path | None = None, is_quick: bool = False
) -> HardwareProfile:
    """This machine's measured profile: ``$FALLBACKGATE_PROFILE``, else the cache, else measured now (the disk
    of `disk_dir`, on the quick grid when `is_quick`)."""
    pinned = os.environ.get(ENV_PROFILE)
    if pinned and not refresh:
        return load_profile_file(pathlib.Path(pinned))
    path = cache_path()
    if path.is_file() and not refresh:
        try:
            return load_profile_file(path)
        except ProfileFileError:
            pass  # a damaged cache is measured again
    from fallbackgate.profiling.run import measure_machine

    if not quiet:
        note = f"measuring this machine once (cached in {path}; `fallbackgate profile --refresh` redoes it)"
        print(note, file=sys.stderr)
    profile, raw = measure_machine(disk_dir, quiet=quiet, is_quick=is_quick)
    save_profile(path, profile, raw)
    return profile


def remeasure_disk(
    profile: HardwareProfile, path: pathlib.Path, disk_dir: pathlib.Path | None = None, is_quick: bool = False
) -> HardwareProfile:
    """`profile` with its disk table and engine I/O path measured again (on `disk_dir`'s file system), saved
    to `path` with the raw measurements `path` already held."""
    from fallbackgate.profiling.disk import disk_grid, measure_disk_table
    from fallbackgate.profiling.engine_io import measure_engine_io

    disk_dir = disk_dir or pathlib.Path(tempfile.gettempdir())
    table = measure_disk_table(disk_dir, *disk_grid(is_quick))
    updated = dataclasses.replace(profile, disk=table, engine_io=measure_engine_io(disk_dir))
    try:
        raw = json.loads(path.read_text()).get("raw", {}) if path.is_file() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        raw = {}
    save_profile(path, updated, raw)
    return updated


def resolve_profile(name: str) -> HardwareProfile:
    """``measured`` or a shipped what-if profile by name."""
    if name == MEASURED:
        return measured_profile()
    return get_profile(name)

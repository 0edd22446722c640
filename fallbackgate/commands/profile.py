"""``fallbackgate profile [--out FILE] [--refresh] [--json]``: measure this machine's hardware profile.

Measures cold disk reads (pages dropped with ``posix_fadvise(DONTNEED)``, read with ``O_DIRECT``), writes
with fsync, host<->device copies, one expert call's wall time by expert size and token count on the CPU and
on the device, and the bundled model's decode step; fits the profile the controllers predict with and caches
it per machine. Without ``--refresh`` it prints the cached profile (measuring only when there is none).
``--out`` also writes it to FILE, which ``$FALLBACKGATE_PROFILE`` can pin for later runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
from typing import Any

from fallbackgate.engine.hardware import HardwareProfile
from fallbackgate.profiling.store import ProfileFileError, cache_path, load_profile_file, measured_profile, save_profile


def add_parser(subparsers: Any) -> None:
    """Register ``profile``."""
    p: argparse.ArgumentParser = subparsers.add_parser("profile", help="measure this machine's hardware profile")
    p.add_argument("--out", default=None, help="also write the profile JSON to this file")
    p.add_argument("--refresh", action="store_true", help="measure again even when a cached profile exists")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _check_out(out: str | None) -> pathlib.Path | None:
    if out is None:
        return None
    path = pathlib.Path(out)
    if path.is_dir() or not path.parent.is_dir():
        problem = "is a directory" if path.is_dir() else "its directory does not exist"
        print(f"error: --out {out}: {problem}", file=sys.stderr)
        raise SystemExit(2)
    return path


def describe(profile: HardwareProfile) -> str:
    """The profile as a short table of rates."""
    gb = 1e9
    rows = [
        ("disk -> host (cold, O_DIRECT)", f"{profile.disk_to_host_bytes_per_s / gb:8.2f} GB/s"),
        ("host -> disk (fsync)", f"{profile.host_to_disk_bytes_per_s / gb:8.2f} GB/s"),
        ("host -> device", f"{profile.host_to_device_bytes_per_s / gb:8.2f} GB/s"),
        ("device -> host", f"{profile.device_to_host_bytes_per_s / gb:8.2f} GB/s"),
        ("device expert weights streamed", f"{profile.device_bytes_per_s / gb:8.2f} GB/s"),
        ("device expert FLOP rate", f"{profile.device_flops / 1e9:8.1f} GFLOP/s"),
        ("CPU expert weights streamed", f"{profile.cpu_expert_bytes_per_s / gb:8.2f} GB/s"),
        ("CPU expert FLOP rate", f"{profile.cpu_expert_flops / 1e9:8.1f} GFLOP/s"),
        ("expert call, fixed", f"{profile.expert_call_s * 1e6:8.1f} µs"),
        ("decoder layer, fixed dense part", f"{profile.layer_overhead_s * 1e6:8.1f} µs"),
        ("engine, fixed per step", f"{profile.step_overhead_s * 1e6:8.1f} µs"),
        ("engine, per request in a step", f"{profile.request_overhead_s * 1e6:8.1f} µs"),
    ]
    head = f"profile {profile.name}" + (f" (measured {profile.measured_at})" if profile.is_measured else " (what-if)")
    return head + "\n" + "\n".join(f"  {name:34s}{value}" for name, value in rows)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fallbackgate profile``."""
    out = _check_out(args.out)
    try:
        profile = measured_profile(refresh=args.refresh, quiet=args.quiet)
    except ProfileFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if out is not None:
        cached = cache_path()
        raw = json.loads(cached.read_text()).get("raw", {}) if cached.is_file() else {}
        save_profile(out, profile, raw)
        load_profile_file(out)
    if args.json:
        print(json.dumps(dataclasses.asdict(profile), indent=2))
    else:
        print(describe(profile))
        print(f"cached in {cache_path()}" + (f"; written to {out}" if out else ""))
    return 0

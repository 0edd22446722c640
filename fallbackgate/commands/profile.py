"""``fallbackgate profile [--out FILE] [--refresh] [--quick] [--disk-only] [--disk-dir DIR] [--json]``: measure
this machine's hardware profile.

Measures cold disk reads (pages dropped with ``posix_fadvise(DONTNEED)``, read with ``O_DIRECT``), writes
with fsync, the disk as latency and bandwidth by transfer size (4 KiB-16 MiB) and queue depth (1-32) for
reads, writes and both mixed (through the engine's I/O scheduler, ``O_DIRECT``, on DIR's file system: the
spill directory's; about 20 s, 8 s with ``--quick``), host<->device copies, one expert call's wall time by
expert size and token count on the CPU and on the device, and the bundled model's decode step; fits the
profile the controllers predict with and caches it per machine. Without ``--refresh`` it prints the cached
profile (measuring only when there is none).
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
from fallbackgate.profiling.store import (
    ProfileFileError,
    cache_path,
    load_profile_file,
    measured_profile,
    remeasure_disk,
    save_profile,
)


def add_parser(subparsers: Any) -> None:
    """Register ``profile``."""
    p: argparse.ArgumentParser = subparsers.add_parser("profile", help="measure this machine's hardware profile")
    p.add_argument("--out", default=None, help="also write the profile JSON to this file")
    p.add_argument("--refresh", action="store_true", help="measure again even when a cached profile exists")
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--quick", action="store_true", help="measure the disk on a smaller grid of sizes and depths")
    p.add_argument(
        "--disk-only", action="store_true", help="measure only the disk table again, into the cached profile"
    )
    p.add_argument(
        "--disk-dir", default=None, help="directory whose disk is measured: the spill directory (default: $TMPDIR)"
    )
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
    rows += _disk_rows(profile)
    head = f"profile {profile.name}" + (f" (measured {profile.measured_at})" if profile.is_measured else " (what-if)")
    return head + "\n" + "\n".join(f"  {name:34s}{value}" for name, value in rows)


def _disk_rows(profile: HardwareProfile) -> list[tuple[str, str]]:
    """Read latency and rate by size at queue depth 1 and at the deepest measured depth."""
    table = profile.disk
    if table is None:
        return [("disk table", "not measured (`fallbackgate profile --disk-only`)")]
    reads = [p for p in table.points if p.op.value == "read"]
    deepest = max(p.queue_depth for p in reads)
    rows = [(f"disk reads ({'O_DIRECT' if table.is_direct else 'buffered'})", f"qd 1 | qd {deepest}")]
    for size in sorted({p.num_bytes for p in reads}):
        at = {p.queue_depth: p for p in reads if p.num_bytes == size}
        cells = [f"{at[d].latency_s * 1e3:8.3f} ms {at[d].bytes_per_s / 1e6:7.1f} MB/s" for d in (1, deepest)]
        rows.append((f"  {size // 1024:>6d} KiB", " | ".join(cells)))
    return rows


def _disk_dir(value: str | None) -> pathlib.Path | None:
    if value is None:
        return None
    path = pathlib.Path(value)
    if not path.is_dir():
        print(f"error: --disk-dir {value}: not a directory", file=sys.stderr)
        raise SystemExit(2)
    return path


def _profile(args: argparse.Namespace) -> HardwareProfile:
    disk_dir = _disk_dir(args.disk_dir)
    if not args.disk_only:
        return measured_profile(refresh=args.refresh, quiet=args.quiet, disk_dir=disk_dir, is_quick=args.quick)
    if not cache_path().is_file():
        print("error: --disk-only: no measured profile yet; run `fallbackgate profile` first", file=sys.stderr)
        raise SystemExit(2)
    return remeasure_disk(load_profile_file(cache_path()), cache_path(), disk_dir, args.quick)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``fallbackgate profile``."""
    out = _check_out(args.out)
    try:
        profile = _profile(args)
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

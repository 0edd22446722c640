"""The profile's engine I/O path: measured through the shared scheduler, and what the simulator prices."""

from __future__ import annotations

import pathlib
import types

import pyarrow as pa
import pytest

from fallbackgate.profiling.engine_io import KIB, measure_engine_io
from fallbackgate.tracing.devices import device_models, fit_profile, fit_profile_disk
from fallbackgate.tracing.schema import TraceTable


def test_engine_io_points_time_each_part(tmp_path: pathlib.Path) -> None:
    table = measure_engine_io(tmp_path, sizes=(64 * KIB, 256 * KIB), depths=(1, 2), reads_per_point=4)
    assert table["num_workers"] >= 1
    assert [(p["num_bytes"], p["queue_depth"]) for p in table["points"]] == [
        (64 * KIB, 1), (64 * KIB, 2), (256 * KIB, 1), (256 * KIB, 2),
    ]  # fmt: skip
    for point in table["points"]:
        assert point["num_reads"] == 4
        assert point["checksum_s"] > 0 and point["copy_s"] > 0 and point["service_s"] > 0
        if point["queue_depth"] == 1:  # one read in flight: its wait holds its whole service
            assert point["wait_s"] >= point["service_s"]
    assert not list(tmp_path.iterdir())  # the scratch file is removed
    misses = table["misses"]  # the engine's own time per miss, through the real store
    assert misses["num_misses"] == 48 and misses["num_bytes"] > 0
    assert misses["mean_wait_s"] > misses["mean_io_s"] > 0
    assert misses["overhead_s"] == pytest.approx(misses["mean_wait_s"] - misses["mean_io_s"], rel=1e-9)


def _trace(engine_points: list[dict], disk_points: list[dict], misses: dict | None = None) -> types.SimpleNamespace:
    engine_io = {"points": engine_points} | ({"misses": misses} if misses else {})
    return types.SimpleNamespace(metadata={"profile": {"engine_io": engine_io, "disk": {"points": disk_points}}})


def test_profile_device_is_the_engine_path_and_disk_stays() -> None:
    latency_s, bandwidth = 1.1e-3, 400e6  # planted: a miss = 1.1 ms + bytes / 400 MB/s through the engine
    engine = [{"num_bytes": n, "queue_depth": 1, "mean_total_s": latency_s + n / bandwidth} for n in (65536, 1 << 20)]
    engine.append({"num_bytes": 65536, "queue_depth": 4, "mean_total_s": 1.0})  # other depths are not fitted
    disk = [{"op": "read", "num_bytes": n, "queue_depth": 1, "latency_s": 1e-4 + n / 2e9} for n in (4096, 1 << 20)]
    trace = _trace(engine, disk)
    device = fit_profile(trace)
    assert device is not None and device.name == "profile"
    assert device.latency_ns == pytest.approx(latency_s * 1e9, rel=1e-6)
    assert device.bandwidth_bytes_per_s == pytest.approx(bandwidth, rel=1e-6)
    pure = fit_profile_disk(trace)
    assert pure is not None and pure.name == "profile-disk"
    assert pure.latency_ns == pytest.approx(1e5, rel=1e-6) and pure.bandwidth_bytes_per_s == pytest.approx(2e9)


def test_profile_without_engine_path_falls_back_to_the_disk() -> None:
    disk = [{"op": "read", "num_bytes": n, "queue_depth": 1, "latency_s": 1e-4 + n / 2e9} for n in (4096, 1 << 20)]
    device = fit_profile(_trace([], disk))
    assert device is not None and device.name == "profile-disk"
    assert fit_profile(_trace([], [])) is None


def test_profile_device_adds_the_engines_own_time_per_miss() -> None:
    """With the measured miss overhead the read's wait is fitted without the points' checksum and copy (the
    overhead holds the engine's own), and the overhead is added to every miss."""
    latency_s, bandwidth, checksum_s, copy_s, overhead_s = 0.4e-3, 800e6, 2e-5, 6e-5, 0.37e-3
    engine = [
        {"num_bytes": n, "queue_depth": 1, "mean_total_s": latency_s + n / bandwidth + checksum_s + copy_s,
         "checksum_s": checksum_s, "copy_s": copy_s}
        for n in (65536, 1 << 20, 4 << 20)
    ]  # fmt: skip
    device = fit_profile(_trace(engine, [], {"overhead_s": overhead_s, "num_misses": 48}))
    assert device is not None and device.name == "profile" and "0.370 ms per miss" in device.source
    assert device.latency_ns == pytest.approx((latency_s + overhead_s) * 1e9, rel=1e-6)
    assert device.bandwidth_bytes_per_s == pytest.approx(bandwidth, rel=1e-6)


def test_a_recording_whose_reads_are_one_size_is_priced_on_its_profile() -> None:
    """Every read an expert's size: no line through them, so the analyses' measured device is the profile's miss
    (what a report showed as what-ifs only before), followed by the two what-ifs."""
    engine = [{"num_bytes": n, "queue_depth": 1, "mean_total_s": 1e-3 + n / 400e6} for n in (65536, 1 << 20)]
    trace = _trace(engine, [])
    reads = {"op": ["read"] * 4, "bytes": [294912] * 4, "start_ns": [0, 10, 20, 30], "end_ns": [5, 16, 27, 38]}
    trace.tables = {TraceTable.IO: pa.table(reads | {"queue_depth": [0] * 4})}
    measured, *what_ifs = device_models(trace)
    assert measured.name == "profile" and not measured.is_what_if
    assert measured.latency_ns == pytest.approx(1e6, rel=1e-6)
    assert [d.is_what_if for d in what_ifs] == [True, True]
    bare = _trace([], [])  # no profile numbers either: the what-ifs alone
    bare.tables = trace.tables
    assert [d.is_what_if for d in device_models(bare)] == [True, True]

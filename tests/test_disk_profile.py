"""The disk as latency plus bandwidth by size and queue depth: the table's predictions, its measurement
(page cache bypassed, checked against the kernel's count), its place in the profile file, and its use by
the controllers' link budget."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest

from fallbackgate.cli import main
from fallbackgate.controllers.link import LinkBudget
from fallbackgate.engine.disk_model import DiskOp, DiskPoint, DiskTable
from fallbackgate.engine.hardware import CPU_BOX
from fallbackgate.engine.io import IOEntry, IOOp, IOSnapshot
from fallbackgate.engine.tags import ObjectKind, Tier
from fallbackgate.profiling import disk, engine_io, store

KIB, MIB = 1024, 1024 * 1024


def _table() -> DiskTable:
    def read(size: int, depth: int, latency_s: float, rate: float) -> DiskPoint:
        return DiskPoint(DiskOp.READ, size, depth, latency_s, 2 * latency_s, rate, 100)

    points = (
        read(4 * KIB, 1, 100e-6, 40e6),
        read(4 * KIB, 4, 200e-6, 80e6),
        read(MIB, 1, 1e-3, 1e9),
        read(MIB, 4, 3e-3, 1.4e9),
        DiskPoint(DiskOp.WRITE, MIB, 1, 2e-3, 4e-3, 0.5e9, 10),
    )
    return DiskTable(points, "/scratch", is_direct=True)


def _read_bytes() -> int:
    for line in pathlib.Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise AssertionError("no read_bytes in /proc/self/io")


def test_table_interpolates_in_size_and_log_depth_and_extrapolates() -> None:
    table = _table()
    assert table.read_s(MIB, 1) == pytest.approx(1e-3) and table.read_s(MIB, 4) == pytest.approx(3e-3)
    half = 4 * KIB + (MIB - 4 * KIB) // 2
    assert table.read_s(half, 1) == pytest.approx((100e-6 + 1e-3) / 2, rel=1e-3)  # linear in bytes
    assert table.read_s(MIB, 2) == pytest.approx(2e-3)  # halfway in log2(depth)
    assert table.read_s(KIB, 1) == pytest.approx(100e-6)  # below the smallest: its fixed cost
    assert table.read_s(4 * MIB, 1) == pytest.approx(4e-3)  # beyond the largest: in proportion to bytes
    assert table.read_s(MIB, 16) == pytest.approx(12e-3)  # beyond the deepest: waits behind the others
    assert table.read_busy_s(MIB, 4) == pytest.approx(MIB / 1.4e9)  # bytes over the rate at that depth
    assert table.read_busy_s(MIB, 16) == pytest.approx(MIB / 1.4e9)  # the rate does not grow past it
    assert table.write_s(MIB) == pytest.approx(2e-3) and table.read_s(0) == 0.0
    assert table.best_read_bytes_per_s(900 * KIB) == pytest.approx(1.4e9)
    with pytest.raises(ValueError, match="positive"):
        DiskPoint(DiskOp.READ, 0, 1, 1e-3, 1e-3, 1e9, 1)


def test_profile_with_a_table_round_trips_and_old_profiles_still_load(tmp_path: pathlib.Path) -> None:
    profile = dataclasses.replace(CPU_BOX, name="measured", is_measured=True, disk=_table())
    path = tmp_path / "p.json"
    store.save_profile(path, profile, {})
    loaded = store.load_profile_file(path)
    assert loaded == profile and loaded.disk.points[0].op is DiskOp.READ
    assert loaded.disk_read_s(MIB, 4) == pytest.approx(3e-3)
    assert loaded.transfer_s(MIB, Tier.DISK, Tier.HOST) == pytest.approx(CPU_BOX.link_latency_s + 1e-3)
    old = json.loads(path.read_text())
    del old["profile"]["disk"]  # a profile written before the table existed
    path.write_text(json.dumps(old))
    legacy = store.load_profile_file(path)
    assert legacy.disk is None
    assert legacy.disk_read_s(MIB) == pytest.approx(MIB / CPU_BOX.disk_to_host_bytes_per_s)
    assert legacy.disk_read_busy_s(MIB, 8) == pytest.approx(MIB / CPU_BOX.disk_to_host_bytes_per_s)


def test_measured_table_reads_come_from_the_disk(tmp_path: pathlib.Path) -> None:
    before = _read_bytes()
    sizes, depths = (4 * KIB, 64 * KIB), (1, 4)
    table = disk.measure_disk_table(tmp_path, sizes, depths, seconds_per_point=0.02, file_bytes=2 * MIB)
    read_during = _read_bytes() - before
    assert not list(tmp_path.iterdir())  # the scratch file is gone
    assert table.directory == str(tmp_path) and table.is_direct  # ext4 under pytest's tmp: O_DIRECT
    keys = {(p.op, p.num_bytes, p.queue_depth) for p in table.points}
    assert keys == {(op, s, d) for op in DiskOp for s in sizes for d in depths}
    for point in table.points:
        assert point.num_transfers >= point.queue_depth and point.latency_s <= point.p99_latency_s
        assert point.bytes_per_s > 0
    timed = sum(p.num_transfers * p.num_bytes for p in table.points if p.op is DiskOp.READ)
    assert read_during >= timed  # every timed read was a device read, though the file was just written
    with pytest.raises(ValueError, match="multiples of 4096"):
        disk.measure_disk_table(tmp_path, (1000,), (1,))


def test_link_budget_predicts_disk_reads_at_the_queue_depth_they_meet() -> None:
    profile = dataclasses.replace(CPU_BOX, disk=_table())
    entry = IOEntry(0, IOOp.READ, ObjectKind.EXPERT, "0:1", MIB, ("r",), 0, 1, 1)
    link = LinkBudget(profile)
    link.reset(1.0, IOSnapshot(0, 4, (entry,), (), 0, 0, 0))
    assert link.disk_queue_depth == 2  # one read in flight, this one
    assert link.disk_arrival_s(MIB) == pytest.approx(2e-3)
    legs = link.legs(MIB, Tier.DISK)
    assert legs[Tier.DISK] == pytest.approx((MIB / 1e9 + MIB / 1.4e9) / 2)  # halfway in log2(depth)
    for _ in range(5):
        link.take(MIB, Tier.DISK)
    assert link.disk_queue_depth == 4  # capped at the scheduler's transfers in flight
    assert link.used_s(Tier.DISK) > link.used_s(Tier.HOST) > 0
    link.reset(1.0)  # no I/O queue: depth 1
    assert link.disk_queue_depth == 1 and link.legs(MIB, Tier.DISK)[Tier.DISK] == pytest.approx(MIB / 1e9)


def test_profile_disk_only_measures_the_table_into_the_cached_profile(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(store.ENV_PROFILE, raising=False)
    monkeypatch.setenv(store.ENV_CACHE, str(tmp_path / "cache"))
    with pytest.raises(SystemExit) as exc:
        main(["profile", "--disk-only", "--quick"])
    assert exc.value.code == 2
    assert "run `fallbackgate profile` first" in capsys.readouterr().err
    store.save_profile(store.cache_path(), dataclasses.replace(CPU_BOX, name="measured"), {"kept": 1})
    monkeypatch.setattr(disk, "disk_grid", lambda is_quick: ((4 * KIB, 16 * KIB), (1, 2)))
    monkeypatch.setattr(disk, "SCRATCH_BYTES", MIB)
    monkeypatch.setattr(disk, "DEFAULT_SECONDS", 0.01)
    monkeypatch.setattr(engine_io, "ENGINE_IO_SIZES", (4 * KIB, 16 * KIB))
    monkeypatch.setattr(engine_io, "READS_PER_POINT", 4)
    spill = tmp_path / "spill"
    spill.mkdir()
    assert main(["profile", "--disk-only", "--quick", "--disk-dir", str(spill)]) == 0
    shown = capsys.readouterr().out
    assert "disk reads (O_DIRECT)" in shown and "16 KiB" in shown
    cached = json.loads(store.cache_path().read_text())
    assert cached["raw"] == {"kept": 1} and cached["profile"]["disk"]["directory"] == str(spill)
    assert len(store.load_profile_file(store.cache_path()).disk.points) == 3 * 2 * 2
    engine_path = store.load_profile_file(store.cache_path()).engine_io  # the engine's I/O path, per size x depth
    assert engine_path is not None and engine_path["directory"] == str(spill)
    assert {(p["num_bytes"], p["queue_depth"]) for p in engine_path["points"]} == {
        (s, d) for s in (4 * KIB, 16 * KIB) for d in engine_io.ENGINE_IO_DEPTHS
    }
    with pytest.raises(SystemExit):
        main(["profile", "--disk-only", "--disk-dir", str(tmp_path / "absent")])


def test_a_policy_disk_rate_replaces_the_measured_table(monkeypatch: pytest.MonkeyPatch) -> None:
    from fallbackgate.policy import loader
    from fallbackgate.policy.schema import HardwareSpec, Policy

    measured = dataclasses.replace(CPU_BOX, name="measured", disk=_table())
    monkeypatch.setattr(loader, "resolve_profile", lambda name: measured)
    assert loader.hardware_profile(Policy(hardware=HardwareSpec(device_flops=1e9))).disk == measured.disk
    overridden = loader.hardware_profile(Policy(hardware=HardwareSpec(disk_to_host_bytes_per_s=1e6)))
    assert overridden.disk is None and overridden.disk_read_s(MIB) == pytest.approx(MIB / 1e6)


def test_a_remembered_prediction_is_the_interpolated_one_and_the_saved_form_is_the_points_alone() -> None:
    """Predictions are indexed and remembered (controllers ask thousands a step): the same seconds as the
    interpolation computed afresh, and neither the index nor the memo enters the table's fields."""
    table = _table()
    for size, depth in ((4096, 1), (6000, 3), (1 << 20, 64), (1, 1)):
        first = table.read_s(size, depth)
        assert table.read_s(size, depth) == first == table._interpolate(DiskOp.READ, size, depth, True)
        assert table.read_busy_s(size, depth) == table._interpolate(DiskOp.READ, size, depth, False)
    saved = dataclasses.asdict(table)
    assert set(saved) == {"points", "directory", "is_direct"}
    assert DiskTable(**saved) == table

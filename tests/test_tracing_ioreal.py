"""``trace simulate --io real`` and ``trace validate``: the device models fitted from a trace, the transfers a
configuration decides performed for real against a scratch file, and (slow) a recorded run predicted by
simulating it with its own configuration."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fallbackgate.cli import main
from fallbackgate.engine.io import IOScheduler
from fallbackgate.engine.io.direct import ALIGN
from fallbackgate.engine.io.requests import IOOp, IORecord
from fallbackgate.engine.tags import ObjectKind
from fallbackgate.tracing import realio
from fallbackgate.tracing.devices import fit_profile, fit_waits
from fallbackgate.tracing.reader import read_trace
from fallbackgate.tracing.realio import RealIO, simulate_real
from fallbackgate.tracing.simulate import SimulationConfig
from fallbackgate.tracing.simulate_input import load_input
from fallbackgate.tracing.simulate_run import simulate_many
from fallbackgate.tracing.simulator import Simulator
from fallbackgate.tracing.synthetic import Planted, write_planted_trace
from fallbackgate.tracing.validate import recorded_budget, recorded_outcome, within

KIB = 1024


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Planted, str]:
    path = tmp_path_factory.mktemp("ioreal") / "trace"
    p = Planted(num_steps_per_phase=20, num_layers=4, num_experts=32, bytes_per_expert=64 * KIB,
                bytes_per_kv_block=16 * KIB, total_budget_bytes=8 << 20)  # fmt: skip
    return write_planted_trace(path, p), str(path)


def test_waits_fit_recovers_the_planted_device(planted: tuple) -> None:
    p, path = planted
    device = fit_waits(read_trace(path))
    assert device is not None and device.name == "waits" and device.queue_depth == 1
    assert device.latency_ns == pytest.approx(p.latency_ns, rel=0.1)
    assert device.bandwidth_bytes_per_s == pytest.approx(p.bandwidth_bytes_per_s, rel=0.1)
    assert fit_profile(read_trace(path)) is None  # the planted trace records no profile


def test_io_real_performs_every_decided_transfer(planted: tuple, tmp_path: Path) -> None:
    p, path = planted
    config = SimulationConfig("exact_lru", p.total_budget_bytes // 2, fit_waits(read_trace(path)))
    simulator = Simulator(load_input(path), config)
    simulator.decide(is_recording=True)
    ops = [op for step in simulator.ops for op in step]
    demand = [[op for op in step if op.requester == "demand"] for step in simulator.ops]
    result = simulate_real(path, [config], RealIO(str(tmp_path), depth=2, pace=False))[0]
    modelled = simulate_many(path, [config], jobs=1)[0]
    assert result["misses_by_tag"] == modelled["misses_by_tag"]  # the same decisions, other pricing
    assert result["num_reads"] == sum(op.op == "read" for op in ops) > 0
    assert result["num_writes"] == sum(op.op == "write" for op in ops)
    for key, moved in result["bytes_moved"].items():  # bytes done: each op's, up to its aligned span
        kind_ops = [op for op in ops if f"{op.kind}:{op.op}" == key]
        asked = sum(op.num_bytes for op in kind_ops)
        assert asked <= moved < asked + 2 * ALIGN * len(kind_ops), key
    assert set(result["bytes_moved"]) == {f"{op.kind}:{op.op}" for op in ops}
    stalls = result["stall_ms_per_step"]
    assert len(stalls) == len(demand)
    assert all((s > 0) == bool(d) for s, d in zip(stalls, demand, strict=True))
    assert result["stall_s"] == pytest.approx(sum(stalls) / 1e3, rel=1e-3)
    assert isinstance(result["is_direct"], bool) and result["io"] == "real"
    assert list(tmp_path.iterdir()) == []  # the scratch file is gone


def test_io_real_orders_and_queues_the_two_kinds_as_asked(
    planted: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``order``: background transfers behind demand reads or in submission order; ``queues``: one scheduler
    for both kinds, or one per kind with half the workers each. The decisions are the same in every case."""
    p, path = planted
    made: list = []

    class Recording(IOScheduler):
        def __init__(self, num_workers: int, max_records: int) -> None:
            super().__init__(num_workers=num_workers, max_records=max_records)
            self.submitted: list[tuple[str, str, int]] = []  # (kind, op, priority)
            made.append(self)

        def submit_read(self, path, offset, num_bytes, kind, object_id, *args, priority=None, **kwargs):  # noqa: ANN001
            self.submitted.append((kind.value, "read", priority))
            return super().submit_read(path, offset, num_bytes, kind, object_id, *args, priority=priority, **kwargs)

        def submit_write(self, path, offset, data, kind, object_id, *args, priority=None, **kwargs):  # noqa: ANN001
            self.submitted.append((kind.value, "write", priority))
            return super().submit_write(path, offset, data, kind, object_id, *args, priority=priority, **kwargs)

    monkeypatch.setattr(realio, "IOScheduler", Recording)
    config = SimulationConfig("exact_lru", p.total_budget_bytes // 2, fit_waits(read_trace(path)))
    results = {}
    for order, queues in (("priority", "shared"), ("fifo", "shared"), ("priority", "by_kind")):
        made.clear()
        real = RealIO(str(tmp_path), pace=False, order=order, queues=queues, workers=2)
        results[order, queues] = simulate_real(path, [config], real)[0]
        submitted = [s for io in made for s in io.submitted]
        writes = [s for s in submitted if s[1] == "write"]
        assert writes and all(kind == "kv_block" for kind, _, _ in writes)  # spilled KV blocks
        assert {priority for _, _, priority in writes} == ({1} if order == "priority" else {0})
        if queues == "shared":
            assert len(made) == 1 and made[0].num_workers == 2
        else:
            assert sorted(io.num_workers for io in made) == [1, 1]
            assert {frozenset(kind for kind, _, _ in io.submitted) for io in made} == {
                frozenset({"expert"}), frozenset({"kv_block"})
            }
    for (order, queues), result in results.items():
        assert (result["io_order"], result["io_queues"], result["io_workers"]) == (order, queues, 2)
        assert result["misses_by_tag"] == results["priority", "shared"]["misses_by_tag"]
    with pytest.raises(ValueError, match="by_kind needs an even --io-workers"):
        RealIO(str(tmp_path), queues="by_kind", workers=3)
    with pytest.raises(ValueError, match="by_kind needs --io-workers >= 2"):
        RealIO(str(tmp_path), queues="by_kind")
    with pytest.raises(ValueError, match="--io-order must be one of priority, fifo"):
        RealIO(str(tmp_path), order="lifo")


def test_cli_io_real_and_validate_refuse_bad_input(planted: tuple, tmp_path: Path) -> None:
    _, path = planted
    out = tmp_path / "sim.json"
    base = ["trace", "simulate", path, "--out", str(out), "--controllers", "exact_lru", "--devices", "waits"]
    assert main([*base, "--io", "fake", str(tmp_path)]) == 2
    assert main([*base, "--io", "real", str(tmp_path / "missing")]) == 2
    assert main([*base, "--io", "real", str(tmp_path), "--no-pace"]) == 0
    assert json.loads(out.read_text())[0]["device"] == f"real:{tmp_path}"
    assert main(["trace", "validate", path]) == 2  # its controller ("planted") is not one of ours


def test_bound_is_max_of_share_and_floor() -> None:
    assert within(1.24, 1.0, 0.0) and not within(1.26, 1.0, 0.0)
    assert within(0.0, 0.01, 0.032) and not within(0.05, 0.01, 0.032)


@pytest.mark.slow
def test_simulating_a_recorded_run_predicts_its_stall_and_tpot(tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    ledger = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    args = ["run", "--device-budget-mb", "1.5", "--trace", str(trace), "--ledger", ledger, "--audit-rate", "0.01"]
    assert main([*args, "--quiet"]) == 0
    recorded = read_trace(trace)
    assert recorded_budget(recorded) == int(1.5 * (1 << 20))
    measured = recorded_outcome(recorded)
    assert measured["stall_s"] > 0  # the budget forces reads from the checkpoint
    out = tmp_path / "validate.json"
    code = main(["trace", "validate", str(trace), "--json", str(out)])
    result = json.loads(out.read_text())
    demand_reads = int((recorded.frame("io")["requester"] == "demand").sum())
    assert result["misses_by_tag"]["expert:exact_load"] == pytest.approx(demand_reads, rel=0.15)
    assert result["stall_within"] and result["tpot_within"] and code == 0, result


def test_measurements_count_bytes_done_and_failures_by_op(tmp_path: Path) -> None:
    """A failed read's partial bytes were moved (they count in ``bytes_moved``), it counts as a read and as a
    failure, never as a write; latencies come from finished reads only."""
    def record(op: IOOp, kind: ObjectKind, asked: int, done: int, error: str = "") -> IORecord:
        return IORecord(0, op, kind, "x", "f", 0, asked, (realio.DEMAND,), 0, 0, 0, 1_000, 2_000_000, done,
                        True, error)  # fmt: skip

    records = [
        record(IOOp.READ, ObjectKind.EXPERT, 8192, 8192),
        record(IOOp.READ, ObjectKind.EXPERT, 8192, 4096, "short read"),
        record(IOOp.WRITE, ObjectKind.KV_BLOCK, 4096, 4096),
    ]
    result = realio._with_measurements({}, RealIO(str(tmp_path)), records, np.zeros(1))
    assert result["bytes_moved"] == {"expert:read": 8192 + 4096, "kv_block:write": 4096}
    assert (result["num_reads"], result["num_writes"], result["num_failed"]) == (2, 1, 1)
    assert result["demand_read_latency_ms_by_kind"]["expert"]["p50"] == pytest.approx(2.0, rel=1e-3)

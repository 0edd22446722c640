"""``trace simulate --io real DIR``: a configuration's I/O performed for real instead of priced on a device model.

The simulator decides every step as usual (:meth:`Simulator.decide` with recording on) and keeps the transfers
its decisions issue: demand reads (the step waits on them), prefetch reads (step-end expert loads) and spill
writes. They are then issued, step by step on the trace's own timing, through the engine's I/O scheduler
(:class:`fallbackgate.engine.io.IOScheduler`: ``O_DIRECT`` where DIR's file system allows it, buffered with a
note where it does not, e.g. tmpfs, which is RAM) against one scratch file of random data in DIR:

- a step's demand reads go layer by layer in trace order, ``depth`` in flight at once (1: one read at a time,
  as the engine's compute thread waits on each miss); the wall time from a layer's first submission to its
  last arrival is that layer's stall, and a step's stall is the sum over its layers;
- its prefetch reads and spill writes are then queued behind (lower priority) and not waited on, so they
  contend with the next steps' demand reads as they would in the engine;
- with ``pace`` the step's compute and host time (the trace's duration less its waits, plus the gap before
  the next step) is slept before the next step, so background transfers overlap compute as they did.

How the two kinds share the device is a choice (PROBE.md: how read-only experts and append-only KV pages
should share an SSD): ``order`` ``priority`` serves waited-on reads before queued prefetches and spill writes
(the engine's order), ``fifo`` in submission order; ``queues`` ``shared`` puts both kinds on one queue of
``workers`` transfers in flight, ``by_kind`` gives experts and KV blocks a queue each with half of them (two
independent links: neither kind's transfers wait behind the other's).

Sizes are the objects' bytes; offsets are the recorded ones where the trace's io table names the object
(an expert's span in its checkpoint file: the read size is then the recorded aligned span), else the
object's slot in the scratch file (experts by (layer, expert), KV blocks in first-write order).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from typing import Any

import numpy as np

from fallbackgate.engine.io import IOScheduler, Ticket
from fallbackgate.engine.io.direct import ALIGN, aligned_buffer, make_scratch_file, round_up
from fallbackgate.engine.tags import ObjectKind
from fallbackgate.tracing.reader import read_trace
from fallbackgate.tracing.schema import TraceTable
from fallbackgate.tracing.simulate import SimulationConfig
from fallbackgate.tracing.simulate_input import SimulationInput, load_input
from fallbackgate.tracing.simulator import IOOp, Simulator


@dataclasses.dataclass(slots=True, frozen=True)
class RealIO:
    """Where and how ``--io real`` issues a configuration's transfers."""

    directory: str  # a directory on the disk (or tmpfs, for RAM) to put the scratch file in
    depth: int = 1  # demand reads in flight at once within a layer
    pace: bool = True  # sleep each step's compute time between steps (the trace's timing)
    overhead_ns_per_read: float = 0.0  # the engine's own work per demand read beyond the I/O, added to the stall
    order: str = "priority"  # "priority": demand reads before queued background transfers; "fifo": as submitted
    queues: str = "shared"  # "shared": one queue for both kinds; "by_kind": experts and KV blocks a queue each
    workers: int | None = None  # transfers in flight in all (None: max(depth, 1)); by_kind: half per kind

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"--io-order must be one of {', '.join(ORDERS)}, got {self.order!r}")
        if self.queues not in QUEUES:
            raise ValueError(f"--io-queues must be one of {', '.join(QUEUES)}, got {self.queues!r}")
        if self.workers is not None and not 1 <= self.workers <= 64:
            raise ValueError(f"--io-workers must be 1..64, got {self.workers}")
        if self.queues == "by_kind" and self.num_workers < 2:
            raise ValueError("--io-queues by_kind needs --io-workers >= 2 (one per kind at least)")
        if self.queues == "by_kind" and self.num_workers % 2:
            raise ValueError(f"--io-queues by_kind needs an even --io-workers (half per kind), got {self.num_workers}")

    @property
    def num_workers(self) -> int:
        """Transfers in flight in all."""
        return self.workers if self.workers is not None else max(self.depth, 1)

    @property
    def background_priority(self) -> int:
        """The serving priority of prefetches and spill writes (demand reads have 0, lower first)."""
        return 1 if self.order == "priority" else 0


ORDERS = ("priority", "fifo")
DEMAND = "demand"  # the requester id a step's waited-on reads carry (prefetches and spill writes carry none)
QUEUES = ("shared", "by_kind")


class Links:
    """The I/O scheduler(s) transfers go through: one shared, or one per object kind, each keeping the record of
    up to `num_transfers` finished transfers (all of a run's: none may fall off its log)."""

    def __init__(self, real: RealIO, num_transfers: int = 1 << 16) -> None:
        keep = max(num_transfers, 1)
        if real.queues == "shared":
            shared = IOScheduler(num_workers=real.num_workers, max_records=keep)
            self.by_kind = {"expert": shared, "kv_block": shared}
        else:
            half = real.num_workers // 2
            self.by_kind = {kind: IOScheduler(num_workers=half, max_records=keep) for kind in ("expert", "kv_block")}
        self.schedulers = list({id(io): io for io in self.by_kind.values()}.values())

    def of(self, op: IOOp) -> IOScheduler:
        """The scheduler an operation goes through."""
        return self.by_kind["expert" if op.kind == "expert" else "kv_block"]

    def __enter__(self) -> Links:
        for io in self.schedulers:
            io.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for io in self.schedulers:
            io.close()

    def take_completed(self) -> list:
        """Every scheduler's finished transfers; RuntimeError if any fell off a scheduler's log."""
        records = [record for io in self.schedulers for record in io.take_completed()]
        if any(io.num_records_dropped for io in self.schedulers):
            raise RuntimeError("finished transfers fell off the I/O scheduler's log: the counts would be short")
        return records


def recorded_spans(path: str) -> dict[str, tuple[int, int]]:
    """Object id -> (offset, bytes) of the trace's recorded expert reads (the first one of each object)."""
    io = read_trace(path).frame(TraceTable.IO)
    reads = io[(io["op"] == "read") & (io["object_kind"] == "expert")].drop_duplicates("object")
    rows = zip(reads["object"], reads["offset"], reads["bytes"], strict=True)
    return {str(o): (int(off), int(n)) for o, off, n in rows}


class ScratchLayout:
    """Where each object's bytes sit in the scratch file."""

    def __init__(self, model: dict[str, int], spans: dict[str, tuple[int, int]], ops: list[list[IOOp]]) -> None:
        self.expert_bytes = round_up(model["bytes_per_expert"])
        self.kv_bytes = round_up(model["bytes_per_kv_block"])
        self.num_experts = model["num_experts"]
        self.spans = spans
        experts_end = model["num_layers"] * self.num_experts * self.expert_bytes
        recorded_end = max((off + n for off, n in spans.values()), default=0)
        self.kv_base = round_up(max(experts_end, recorded_end))
        self.kv_slots: dict[tuple, int] = {}
        for step in ops:
            for op in step:
                if op.kind == "kv_block":
                    self.kv_slots.setdefault(op.key, len(self.kv_slots))
        self.size = self.kv_base + len(self.kv_slots) * self.kv_bytes

    def place(self, op: IOOp) -> tuple[int, int]:
        """(offset, bytes) of one transfer."""
        if op.kind == "expert":
            recorded = self.spans.get(f"{op.key[0]}:{op.key[1]}")
            if recorded is not None and 0 <= recorded[1] - op.num_bytes < 2 * ALIGN:  # the full object's span
                return recorded
            return (op.key[0] * self.num_experts + op.key[1]) * self.expert_bytes, op.num_bytes
        return self.kv_base + self.kv_slots[op.key] * self.kv_bytes, op.num_bytes


def _issue(
    links: Links, path: str, layout: ScratchLayout, op: IOOp, into: Any, priority: int, data: Any
) -> tuple[IOScheduler, Ticket]:
    """Queue one transfer on its kind's scheduler; that scheduler and its ticket."""
    io = links.of(op)
    offset, num = layout.place(op)
    kind = ObjectKind.EXPERT if op.kind == "expert" else ObjectKind.KV_BLOCK
    name = ":".join(map(str, op.key))
    requesters = (DEMAND,) if op.requester == "demand" else ()
    if op.op == "write":
        return io, io.submit_write(path, offset, data[:num], kind, name, requesters, priority=priority)
    return io, io.submit_read(path, offset, num, kind, name, requesters, into=into, priority=priority)


def _demand_stall(links: Links, path: str, layout: ScratchLayout, reads: list[IOOp], depth: int, pool: list) -> int:
    """Issue one step's demand reads layer by layer, ``depth`` at a time; the summed wall time waited (ns)."""
    stall = 0
    if not reads:
        return 0
    layers: dict[int, list[IOOp]] = {}
    for op in reads:
        layers.setdefault(op.layer, []).append(op)
    for ops in layers.values():
        started = time.monotonic_ns()
        for first in range(0, len(ops), depth):
            batch = ops[first : first + depth]
            tickets = [_issue(links, path, layout, op, pool[i], 0, None) for i, op in enumerate(batch)]
            for io, ticket in tickets:
                io.wait(ticket)
        stall += time.monotonic_ns() - started
    return stall


def run_real(data: SimulationInput, config: SimulationConfig, trace_path: str, real: RealIO) -> dict[str, Any]:
    """One configuration with its transfers performed against a scratch file in ``real.directory``, at the
    objects' sizes in the configuration (a bytes-scale what-if moves its scaled sizes)."""
    simulator = Simulator(data, config)
    simulator.decide(is_recording=True)
    ops = simulator.ops or []
    view = simulator.view
    sizes = {"bytes_per_expert": view.bytes_per_expert, "bytes_per_kv_block": view.bytes_per_kv_block}
    spans = recorded_spans(trace_path) if config.expert_bytes_scale == 1.0 else {}  # the recorded experts' extents
    layout = ScratchLayout(data.model | sizes, spans, ops)
    free = shutil.disk_usage(real.directory).free
    if layout.size > 0.9 * free:
        raise ValueError(f"--io real {real.directory}: the scratch file needs {layout.size} bytes, {free} are free")
    path = os.path.join(real.directory, f"fallbackgate-ioreal-{os.getpid()}.bin")
    make_scratch_file(path, max(layout.size, 4096))
    largest = max([layout.place(op)[1] for step in ops for op in step] or [4096])
    pool = [memoryview(aligned_buffer(largest)) for _ in range(real.depth)]
    write_data = memoryview(aligned_buffer(largest))
    timeline = data.timeline
    gaps = timeline.compute_ns + (timeline.between_ns if timeline.between_ns is not None else 0.0)
    stall = np.zeros(len(ops))
    background: list[Ticket] = []
    try:
        with Links(real, sum(len(step) for step in ops)) as links:
            for index, step in enumerate(ops):
                demand = [op for op in step if op.requester == "demand"]
                waited = _demand_stall(links, path, layout, demand, real.depth, pool)
                stall[index] = waited + real.overhead_ns_per_read * len(demand)
                background = [(io, t) for io, t in background if not t.done.is_set()]
                rest = [op for op in step if op.requester != "demand"]
                priority = real.background_priority
                background += [_issue(links, path, layout, op, None, priority, write_data) for op in rest]
                if real.pace:
                    time.sleep(max(float(gaps[index]), 0.0) / 1e9)
            for io, ticket in background:
                io.wait(ticket)
            records = links.take_completed()
    finally:
        os.unlink(path)
    return _with_measurements(simulator.result(stall), real, records, stall)


def _with_measurements(result: dict[str, Any], real: RealIO, records: list, stall: np.ndarray) -> dict[str, Any]:
    reads = [r for r in records if r.op.value == "read" and not r.error]  # the latencies: finished reads only
    service_ms = np.array([r.service_s * 1e3 for r in reads]) if reads else np.zeros(1)
    is_direct = all(r.is_direct for r in records) if records else None
    by_kind: dict[str, dict[str, float]] = {}
    demand = [r for r in reads if r.requester_ids == (DEMAND,)]
    for kind in sorted({r.object_kind.value for r in demand}):  # waited-on reads, submission to arrival
        kind_ms = np.array([(r.wait_s + r.service_s) * 1e3 for r in demand if r.object_kind.value == kind])
        by_kind[kind] = {"p50": float(np.percentile(kind_ms, 50)), "p99": float(np.percentile(kind_ms, 99))}
    moved: dict[str, int] = {}  # bytes each transfer really moved, a failed one's partial bytes included
    for r in records:
        key = f"{r.object_kind.value}:{r.op.value}"
        moved[key] = moved.get(key, 0) + r.num_bytes_done
    result.update({
        "device": f"real:{real.directory}", "io": "real", "io_depth": real.depth, "is_paced": real.pace,
        "io_order": real.order, "io_queues": real.queues, "io_workers": real.num_workers,
        "overhead_ms_per_read": real.overhead_ns_per_read / 1e6, "is_direct": is_direct,
        "num_reads": sum(r.op.value == "read" for r in records),
        "num_writes": sum(r.op.value == "write" for r in records), "num_failed": sum(bool(r.error) for r in records),
        "read_service_ms": {"p50": float(np.percentile(service_ms, 50)), "p99": float(np.percentile(service_ms, 99)),
                            "max": float(service_ms.max())},
        "demand_read_latency_ms_by_kind": by_kind, "bytes_moved": moved,
        "stall_ms_per_step": [round(float(s) / 1e6, 4) for s in stall],
        "note": "" if is_direct or is_direct is None else
        f"{real.directory}'s file system refused O_DIRECT (e.g. tmpfs, i.e. RAM): reads were buffered",
    })  # fmt: skip
    return result


def simulate_real(path: str, configs: list[SimulationConfig], real: RealIO) -> list[dict[str, Any]]:
    """Every configuration, one after another (they share the real device), with ``--io real``."""
    data = load_input(path)
    return [run_real(data, config, path, real) for config in configs]

"""Recording a trace live (``run --trace DIR``, ``serve --trace DIR``): once per step the engine's
:class:`~fallbackgate.engine.messages.StepCapture` (routing tensors per layer, the uses and blocks not served
resident from device) is expanded into ``expert_access`` and ``kv_access`` rows with numpy, never a Python
loop over accesses; the I/O scheduler's completed transfers, the controller's arbitrations and each
finished request are appended as batches. The run recorder owns one :class:`LiveTracer` per run.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from fallbackgate.engine.hardware import profile_record
from fallbackgate.engine.io import IOOp, IORecord
from fallbackgate.engine.messages import RequestOutput, RoutingCall, StepCapture, StepKind, StepPlan, StepResult
from fallbackgate.engine.tags import ObjectKind, Tag, Tier
from fallbackgate.tracing.access_columns import KVPending, expert_columns
from fallbackgate.tracing.batches import RowBatches
from fallbackgate.tracing.schema import ArbitrationOption, Phase, TraceTable
from fallbackgate.tracing.writer import TraceWriter

KEPT_STEPS = 8192  # recent steps' starts kept to place completed I/O in the step that issued it
STEP_ROWS_PER_BATCH = 8192  # steps rows kept before they are handed on as one batch
STEP_COLUMNS = ("step", "phase", "start_ns", "end_ns", "batch", "tokens")  # a kept steps row's fields
PHASE_OF_KIND = {StepKind.PREFILL: Phase.PREFILL, StepKind.DECODE: Phase.DECODE, StepKind.MIXED: Phase.MIXED,
                 StepKind.RECOMPUTE: Phase.PREFILL}  # fmt: skip  # a rebuild re-runs prompt-like tokens
PHASE_CODE = {kind: list(Phase).index(phase) for kind, phase in PHASE_OF_KIND.items()}  # codes into the schema's
_KV_OPTION = {Tag.EXACT_LOAD: ArbitrationOption.KV_FIRST, Tag.RECOMPUTE: ArbitrationOption.RECOMPUTE,
              Tag.KV_DEQUANT: ArbitrationOption.DEQUANT}  # fmt: skip
_EXPERT_OPTION = {Tag.EXACT_LOAD: ArbitrationOption.EXPERT_FIRST, Tag.EXPERT_LOWBIT: ArbitrationOption.LOWBIT,
                  Tag.EXPERT_DEFER: ArbitrationOption.DEFER,
                  Tag.CPU_EXECUTE: ArbitrationOption.CPU_EXECUTE}  # fmt: skip


def engine_metadata(engine: Any) -> dict[str, Any]:
    """The model shape, budgets and profile of an engine, as ``metadata.json`` records them."""
    store, kv, config = engine.expert_store, engine.kv_store, engine.config
    layers = sorted(engine.loaded_experts)
    return {
        "model": {
            "num_layers": int(kv.num_layers), "num_moe_layers": len(layers), "moe_layers": layers,
            "num_experts": int(getattr(engine.model_config, "num_experts", 0)
                               or getattr(engine.model_config, "num_local_experts", 0)),
            "top_k": int(engine.executor.top_k), "bytes_per_expert": int(store.bytes_per_expert),
            "bytes_per_kv_block": int(kv.bytes_per_block), "block_size": int(kv.block_size),
            "dtype": engine.dtype_name, "path": config.model_dir,
        },
        "budgets": {"device_bytes": config.device_budget_bytes, "host_bytes": config.host_budget_bytes,
                    "expert_fraction": getattr(engine.controller, "expert_fraction", None)},
        "profile": profile_record(config.profile),
        "prefix_reuse": bool(config.is_prefix_reused),
    }  # fmt: skip


class LiveTracer:
    """Writes one engine's run into a new trace directory as it runs (every access, no sampling)."""

    def __init__(self, directory: str | os.PathLike[str], engine: Any, metadata: Mapping[str, Any]):
        """``metadata``: what the caller adds (controller, workload, source, ...) to the engine's shape."""
        started, started_cpu = time.perf_counter_ns(), time.thread_time_ns()
        self.engine = engine
        self.writer = TraceWriter(directory, {"source": "recorded", **engine_metadata(engine), **metadata})
        self.batches = RowBatches(self.writer)  # steps' rows, appended to the writer in larger batches
        self.routing: list[RoutingCall] = []  # routing calls of the steps not yet expanded into rows
        self.routing_steps: list[int] = []  # each one's step
        self.served: list[tuple] = []  # their uses not served resident (StepCapture.expert_served, call index
        # into self.routing)
        self.num_routed = 0  # expert_access rows they will make
        self.kv = KVPending()  # KV reads of the steps not yet expanded into rows
        self.num_kv_rows = 0  # kv_access rows they will make
        self.clock_offset_ns = time.monotonic_ns() - time.perf_counter_ns()  # perf_counter -> monotonic
        self.step_rows: list[tuple[int, ...]] = []  # steps rows not yet handed on, in STEP_COLUMNS order
        self.step_ids: list[int] = []  # recorded steps, in order
        self.step_starts: list[int] = []  # their start_ns (to place an I/O in the step that issued it)
        self.num_decisions = 0  # arbitration decisions written so far
        engine.is_capturing = True
        self.spent_ns = time.perf_counter_ns() - started  # wall ns spent inside this tracer, its start included
        self.spent_cpu_ns = time.thread_time_ns() - started_cpu  # CPU ns of the calling thread spent inside it
        # (what the machine's load leaves out); the sink's thread: `sink_cpu_ns`

    @property
    def sink_cpu_ns(self) -> int:
        """CPU ns the trace's sink thread has spent converting and writing row groups."""
        return self.writer.sink_cpu_ns

    @property
    def directory(self) -> str:
        """The trace directory, absolute."""
        return str(self.writer.directory.resolve())

    @contextlib.contextmanager
    def _spending(self) -> Iterator[None]:
        """Adds the block's wall time and the calling thread's CPU time to the tracer's own."""
        started, started_cpu = time.perf_counter_ns(), time.thread_time_ns()
        try:
            yield
        finally:
            self.spent_ns += time.perf_counter_ns() - started
            self.spent_cpu_ns += time.thread_time_ns() - started_cpu

    def on_step(self, plan: StepPlan, result: StepResult, arbitrations: Sequence[Any] = ()) -> None:
        """Record one step: its row, its expert and KV accesses, the I/O completed since, its arbitrations."""
        with self._spending():
            self._step(plan, result, arbitrations)

    def _step(self, plan: StepPlan, result: StepResult, arbitrations: Sequence[Any]) -> None:
        cap = result.capture
        if cap is None:
            raise ValueError(f"step {result.step_id} has no capture: the engine was not capturing")
        names = tuple(plan.request_ids)
        seen: set[int] = set()  # a forward's calls share one request_ids list: check it once
        for call in cap.routing:  # a rebuild pass's request is the step's too; keep unknown ones findable
            if id(call.request_ids) not in seen:
                seen.add(id(call.request_ids))
                extra = [rid for rid in call.request_ids if rid not in names]
                names += tuple(dict.fromkeys(extra))
        tokens = sum(int(c.token_owner.numel()) for c in cap.routing if c.layer == cap.routing[0].layer)
        tokens = tokens or sum(plan.num_tokens.values())
        self.step_rows.append((result.step_id, PHASE_CODE[plan.kind], cap.start_ns, cap.end_ns,
                               len(plan.request_ids), tokens))  # fmt: skip
        if len(self.step_rows) >= STEP_ROWS_PER_BATCH:
            self.flush_steps()
        self.step_ids.append(result.step_id)
        self.step_starts.append(cap.start_ns)
        if len(self.step_ids) > KEPT_STEPS:  # an I/O completes steps, not thousands of steps, after it was issued
            del self.step_ids[: KEPT_STEPS // 2], self.step_starts[: KEPT_STEPS // 2]
        run_wide = self.batches.code_map(names)  # registers new request ids (the expert rows' codes)
        if cap.routing:  # expanded in batches of steps (flush_experts): the per-step share stays small
            offset = len(self.routing)
            self.routing += cap.routing
            self.routing_steps += [result.step_id] * len(cap.routing)
            self.served += [(offset + c, *rest) for c, *rest in cap.expert_served]
            self.num_routed += sum(int(c.top_k_index.numel()) for c in cap.routing)
            if self.num_routed >= self.batches.max_rows:
                self.flush_experts()
        if cap.kv_reads:
            self.num_kv_rows += self.kv.add(result.step_id, cap, run_wide) * self.engine.kv_store.num_layers
            if self.num_kv_rows >= self.batches.max_rows:
                self.flush_kv()
        self.record_io(self.engine.io.take_completed())
        if arbitrations:
            self._arbitrations(plan, result, arbitrations)

    def flush_steps(self) -> None:
        """Hand the kept ``steps`` rows on as one batch."""
        if self.step_rows:
            rows = np.array(self.step_rows, dtype=np.int64)
            self.batches.add(TraceTable.STEPS, len(rows), dict(zip(STEP_COLUMNS, rows.T, strict=True)))
            self.step_rows = []

    def flush_experts(self) -> None:
        """Expand the kept routing calls into ``expert_access`` rows (one pass over many steps)."""
        if not self.routing:
            return
        cap = StepCapture(0, 0, self.routing, self.served)
        columns = expert_columns(np.array(self.routing_steps), cap, self.batches.names, self.batches.codes)
        columns["request"] = columns["request"].index
        self.batches.add(TraceTable.EXPERT_ACCESS, len(columns["step"]), columns)
        self.routing, self.routing_steps, self.served, self.num_routed = [], [], [], 0

    def flush_kv(self) -> None:
        """Expand the kept KV reads into ``kv_access`` rows (one pass over many steps)."""
        if len(self.kv):
            columns = self.kv.columns(self.engine.kv_store.num_layers)
            self.batches.add(TraceTable.KV_ACCESS, len(columns["step"]), columns)
        self.kv, self.num_kv_rows = KVPending(), 0

    def record_io(self, records: Sequence[IORecord]) -> None:
        """Append completed transfers; each goes to the step whose start precedes its submission."""
        if not records:
            return
        submit = np.array([r.submit_ns for r in records], dtype=np.int64)
        position = np.searchsorted(np.array(self.step_starts, dtype=np.int64), submit, side="right") - 1
        steps = np.array(self.step_ids or [0], dtype=np.int64)[np.clip(position, 0, None)]
        self.writer.append(
            TraceTable.IO, step=steps, op=[r.op.value for r in records],
            object_kind=[r.object_kind.value for r in records], object=[r.object_id for r in records],
            tier=[Tier.DISK.value] * len(records), bytes=[r.num_bytes_done or r.num_bytes for r in records],
            offset=[r.offset for r in records], submit_ns=submit, start_ns=[r.start_ns or r.submit_ns for r in records],
            end_ns=[r.end_ns for r in records], queue_depth=[r.queue_depth_at_submit for r in records],
            requester=[_requester(r) for r in records],
        )  # fmt: skip

    def _arbitrations(self, plan: StepPlan, result: StepResult, arbitrations: Sequence[Any]) -> None:
        """One row per option weighed; the chosen one carries the measured arrival where the engine has it."""
        ready = {(s.request_id, s.layer, s.block_index): s for s in result.kv_stagings}
        bytes_of = {ObjectKind.KV_BLOCK: self.engine.kv_store.bytes_per_block,
                    ObjectKind.EXPERT: self.engine.expert_store.bytes_per_expert}  # fmt: skip
        cols: dict[str, list[Any]] = {n: [] for n in ("decision", "request", "layer", "context", "option", "ns",
                                                      "nats", "bytes", "chosen", "outcome")}  # fmt: skip
        for a in arbitrations:
            request_id, layer, _ = a.object_key
            options = _KV_OPTION if a.object_kind is ObjectKind.KV_BLOCK else _EXPERT_OPTION
            staged = ready.get(a.object_key) if a.object_kind is ObjectKind.KV_BLOCK else None
            context = plan.start_positions.get(request_id, 0) + plan.num_tokens.get(request_id, 0)
            for option in a.options:
                if option.tag not in options:
                    continue
                is_chosen = option.tag is a.choice
                moved = staged.bytes_moved if is_chosen and staged is not None else (
                    bytes_of[a.object_kind] if option.tag is Tag.EXACT_LOAD else 0)  # fmt: skip
                outcome = int(staged.ready_s * 1e9) if is_chosen and staged is not None else None
                for name, value in (("decision", self.num_decisions), ("request", request_id), ("layer", layer),
                                    ("context", context), ("option", options[option.tag].value),
                                    ("ns", int(option.predicted_s * 1e9)), ("nats", float(option.predicted_cost)),
                                    ("bytes", int(moved)), ("chosen", is_chosen), ("outcome", outcome)):  # fmt: skip
                    cols[name].append(value)
            self.num_decisions += 1
        if not cols["decision"]:
            return
        n = len(cols["decision"])
        self.writer.append(
            TraceTable.ARBITRATION, decision=cols["decision"], step=np.full(n, result.step_id),
            request=cols["request"], layer=cols["layer"], phase=[PHASE_OF_KIND[plan.kind].value] * n,
            context_tokens=cols["context"], option=cols["option"], predicted_ns=cols["ns"],
            predicted_quality_nats=cols["nats"], bytes=cols["bytes"], is_chosen=cols["chosen"],
            outcome_ns=np.array(cols["outcome"], dtype=object),
        )  # fmt: skip

    def on_request(self, output: RequestOutput, slo: Mapping[str, Any] | None = None) -> None:
        """Record a request that ended (times on the trace's clock; its class's SLO targets when it has one)."""
        with self._spending():
            self._append_request(output, slo or {})

    def _append_request(self, output: RequestOutput, slo: Mapping[str, Any]) -> None:
        def ns(seconds: float) -> int | None:
            return int(seconds * 1e9) + self.clock_offset_ns if seconds else None

        def slo_ns(key: str) -> int | None:
            value = slo.get(key)
            return None if value is None else int(float(value) * 1e6)

        self.writer.append(
            TraceTable.REQUESTS, request=[output.request_id], request_class=[output.request_class],
            slo_ttft_ns=np.array([slo_ns("ttft_ms")], dtype=object), slo_tpot_ns=np.array([slo_ns("tpot_ms")], object),
            arrival_ns=[ns(output.arrival_s) or 0],
            first_token_ns=np.array([ns(output.first_token_s) if output.output_token_ids else None], dtype=object),
            finish_ns=np.array([ns(output.finish_s)], dtype=object),
            prompt_tokens=[len(output.prompt_token_ids)], output_tokens=[len(output.output_token_ids)],
        )  # fmt: skip

    def close(self) -> None:
        """Take the last completed transfers, write every buffered row and the metadata; stop capturing."""
        if self.writer.is_closed:
            return
        with self._spending():
            try:
                self.record_io(self.engine.io.take_completed())
                self.flush_steps()
                self.flush_experts()
                self.flush_kv()
                self.batches.flush()
            finally:
                self.engine.is_capturing = False
                self.writer.close()


def _requester(record: IORecord) -> str:
    """Who asked: a read some request waits on is ``demand``, one nobody waits on ``prefetch``, a write
    ``spill``."""
    if record.op is IOOp.WRITE:
        return "spill"
    return "demand" if record.requester_ids else "prefetch"

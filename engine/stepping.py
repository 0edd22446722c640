"""One engine step: schedule, make KV usable, run one packed forward, sample, and carry out the controller's
step-end actions (the stepping half of :class:`~fallbackgate.engine.engine.Engine`)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.controller import Controller, ControllerView
from fallbackgate.engine.device_pool import HeldCopy
from fallbackgate.engine.experts.executor import Executor
from fallbackgate.engine.experts.integrity import CopyVerifier
from fallbackgate.engine.experts.store import ExpertStore
from fallbackgate.engine.kv.prefix_cache import PrefixCache
from fallbackgate.engine.kv.store import KVStore
from fallbackgate.engine.messages import RequestOutput, StepCapture, StepKind, StepPlan, StepResult
from fallbackgate.engine.model.runner import ModelRunner
from fallbackgate.engine.outputs import count_tags, keep_prompt_logprobs, request_output, sample_rows
from fallbackgate.engine.packing import pack_step
from fallbackgate.engine.scheduler import Scheduler
from fallbackgate.engine.sequence import Sequence
from fallbackgate.engine.step_context import EventLog, StepUses
from fallbackgate.engine.step_log import log_prefetches, log_resumed
from fallbackgate.engine.tags import ObjectKind
from fallbackgate.engine.view import LiveView


class EngineStepping:
    """Runs the engine's steps over the parts :class:`~fallbackgate.engine.engine.Engine` builds."""

    config: EngineConfig
    controller: Controller
    scheduler: Scheduler
    executor: Executor
    runner: ModelRunner
    prefix: PrefixCache
    kv_store: KVStore
    expert_store: ExpertStore
    verifier: CopyVerifier
    sequences: dict[str, Sequence]  # unfinished requests only
    finished: dict[str, RequestOutput]
    failed: dict[str, tuple[RequestOutput, str]]  # ended by a fault only they met: output, why
    modeled_clock_s: float
    is_observe: bool
    last_plan: StepPlan | None
    is_capturing: bool
    _view: LiveView
    step_uses: StepUses  # shared with the view: the step's uses and the measured decode compute time
    view: Callable[[], ControllerView]  # Engine.view(): what controllers are shown
    abort_request: Callable[..., RequestOutput]  # Engine.abort_request(request_id, is_kept=True)

    def step(self) -> StepResult:
        """Schedule, make KV usable, run one packed forward, sample, and let the controller tidy up."""
        started = time.perf_counter()
        self.kv_store.finish_writes()  # the last step's spill writes, queued behind it
        plan, chosen = self.scheduler.schedule()
        plan.is_observe = self.is_observe
        self.last_plan = plan
        self.controller.on_step_start(plan, self.view())
        log = self._prepare(plan, chosen, started)
        live = [(seq, num) for seq, num in chosen if seq.request_id not in log.failed]  # unreadable KV: it leaves
        logits = self._forward(plan, live, log) if live else torch.empty(0)
        return self._finish_step(plan, live, logits, log, started)

    def _prepare(self, plan: StepPlan, chosen: list[tuple[Sequence, int]], started: float) -> EventLog:
        log = EventLog(plan.step_id, started)
        if self.is_capturing:
            log.capture = StepCapture(time.monotonic_ns() - int(1e9 * (time.perf_counter() - started)))
        log.modeled_transfer_s += self.executor.take_pending_modeled_s()
        log_resumed(log, self.config.profile, self.scheduler.restored)
        self.scheduler.restored.clear()
        self.runner.resolve_kv(plan.step_id, chosen, log, self.is_observe, self.scheduler.is_layer_staged)
        return log

    def _forward(self, plan: StepPlan, chosen: list[tuple[Sequence, int]], log: EventLog) -> torch.Tensor:
        packed = pack_step(chosen, log, self.prefix, self.config.block_size, self.kv_store.num_layers)
        batch, token_ids, rows, scored = packed.batch, packed.token_ids, packed.rows, packed.scored
        if not scored and not packed.prompt_rows:
            return self.runner.forward(plan.step_id, batch, token_ids, rows, log, self.is_observe)
        extra = [r for _, _, r in scored] + [r for _, _, r in packed.prompt_rows]
        logits = self.runner.forward(plan.step_id, batch, token_ids, rows + extra, log, self.is_observe)
        for i, (seq, position, _) in enumerate(scored, start=len(rows)):
            seq.prompt_logits[position] = logits[i].detach().cpu()
        keep_prompt_logprobs(packed.prompt_rows, logits[len(rows) + len(scored) :])
        return logits[: len(rows)]

    def _finish_step(
        self, plan: StepPlan, chosen: list[tuple[Sequence, int]], logits: torch.Tensor, log: EventLog, started: float
    ) -> StepResult:
        self._end_step(log)
        sampled, kept, own = sample_rows(chosen, logits, log.failed)
        finished = []
        events = log.events()
        self.prefix.note_events(plan, events)
        self.prefix.share_computed(seq for seq, _ in chosen)  # full exact blocks adoptable while they still run
        modeled = log.modeled_transfer_s + log.modeled_compute_s
        self.modeled_clock_s += modeled
        now = time.perf_counter()
        count_tags(self.sequences, log, events)
        for request_id, token in sampled.items():
            if self._append_token(self.sequences[request_id], token, own.get(request_id), now):
                finished.append(request_id)
        for request_id, why in log.failed.items():
            if request_id in self.sequences:
                self.failed[request_id] = (self.abort_request(request_id, is_kept=False), why)
        pool = self.kv_store.device_pool
        clock = self.expert_store.read_ahead.end_step()
        if plan.kind is StepKind.DECODE:
            self.step_uses.note_decode_step(now - started, clock.exposed_s if clock is not None else 0.0)
        if log.capture is not None:
            log.capture.end_ns = time.monotonic_ns()
        return StepResult(
            plan.step_id,
            plan.kind,
            plan.request_ids,
            sampled,
            kept,
            events,
            now - started,
            modeled,
            finished,
            pool.used_bytes_by_kind[ObjectKind.EXPERT] + pool.used_bytes_by_kind[HeldCopy.EXPERT_LOWBIT],
            pool.used_bytes_by_kind[ObjectKind.KV_BLOCK],
            clock,
            self.verifier.verify_step(plan.step_id),
            log.kv_resident_reads,
            list(log.kv_stagings.values()),
            log.expert_resident_uses,
            log.routing_digests,
            list(log.expert_arrivals.values()),
            self.kv_store.take_copy_changes(),
            log.capture,
            dict(log.failed),
        )

    def _end_step(self, log: EventLog) -> None:
        """Between steps: the controller's step-end actions, each carried out by the part that owns the
        objects (in this order: spills, evictions, promotions, prefetches), then per-step state reset. The
        spills' disk writes are queued, not waited for: the next step waits for them before it schedules."""
        actions = self.controller.on_step_end(self._view)
        self.executor.end_step(actions.spill, is_behind=True)
        self.expert_store.evict_chosen(actions.evict_experts)
        self.kv_store.promote_chosen(actions.promote_kv)
        log_prefetches(log, self.config.profile, self.expert_store.end_step(actions.load_experts, log.step_id + 1))
        self.kv_store.clear_scratch()

    def _append_token(self, seq: Sequence, token: int, kept: torch.Tensor | None, now: float) -> bool:
        if not seq.output_token_ids:
            seq.first_token_s, seq.modeled_first_token_s = now, self.modeled_clock_s
        seq.output_token_ids.append(token)
        if kept is not None:
            seq.output_logits.append(kept)
        is_done = len(seq.output_token_ids) >= seq.params.max_new_tokens or token in seq.params.stop_token_ids
        if is_done:
            seq.finish_s, seq.modeled_finish_s = now, self.modeled_clock_s
            self.scheduler.finish(seq)
            self.prefix.release(seq)  # its exact full blocks are kept for later prefixes, the rest freed
            self.finished[seq.request_id] = request_output(seq)
            del self.sequences[seq.request_id]  # its output is the caller's to take from `finished`
        return is_done

"""The engine: requests in, tagged steps out."""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Iterable

import torch
from tqdm.auto import tqdm

from fallbackgate.engine import requests
from fallbackgate.engine.baseline.access import BaselineAccess
from fallbackgate.engine.config import DTYPES, EngineConfig, PreemptMode
from fallbackgate.engine.controller import Controller, ControllerView
from fallbackgate.engine.errors import EngineError
from fallbackgate.engine.experts.executor import Executor
from fallbackgate.engine.experts.integrity import CopyVerifier
from fallbackgate.engine.io import IOScheduler
from fallbackgate.engine.kv import paged_attention
from fallbackgate.engine.kv.prefix_cache import PrefixCache
from fallbackgate.engine.kv.store import KVBlockKey
from fallbackgate.engine.messages import RequestOutput, StepPlan
from fallbackgate.engine.model.build import (
    Budgets,
    KVShape,
    build_stores,
    fill_expert_tiers,
    probe_kv_shapes,
    resolve_device,
)
from fallbackgate.engine.model.compiled import CompiledDecode
from fallbackgate.engine.model.loader import LoadedCheckpoint, find_routers, load_checkpoint
from fallbackgate.engine.model.runner import ModelRunner
from fallbackgate.engine.outputs import request_output
from fallbackgate.engine.pressure import make_room_for_kv, preempt
from fallbackgate.engine.scheduler import Scheduler
from fallbackgate.engine.sequence import SamplingParams, Sequence
from fallbackgate.engine.step_context import StepUses
from fallbackgate.engine.step_log import ENGINE_REQUEST_ID
from fallbackgate.engine.stepping import EngineStepping
from fallbackgate.engine.view import LiveView

__all__ = ["ENGINE_REQUEST_ID", "Engine"]  # ENGINE_REQUEST_ID: where the ledger has always imported it from


class Engine(BaselineAccess, EngineStepping):
    """A joint-offload MoE engine over a transformers checkpoint; the controller decides every fallback."""

    def __init__(self, config: EngineConfig, controller: Controller) -> None:
        self.config, self.controller = config, controller
        loaded = load_checkpoint(config.model_dir, dtype=DTYPES[config.dtype] if config.dtype else None)
        self.dtype = loaded.dtype
        self.tokenizer, self.model_config = loaded.tokenizer, loaded.model.config
        self.device = resolve_device(config.device)
        shape = probe_kv_shapes(loaded)
        expert_floor, budgets = self._attach_stores(config, loaded, shape)
        model = loaded.model.to(self.device)
        fill_expert_tiers(config, loaded, self.expert_store, budgets)
        self.loaded_experts = loaded.experts_by_layer  # decoder layer -> routed-experts module
        self.dense_digests = loaded.dense_digests  # what an audit checks the live dense weights against
        self.verifier = CopyVerifier(
            self.expert_store, loaded.checkpoint_dtype, config.num_verified_copies_per_step, config.seed
        )
        self.sequences: dict[str, Sequence] = {}  # unfinished requests only: a finished one leaves at once
        self.num_added = 0  # requests accepted so far: default ids and seeds count from it
        self._used_ids: set[str] = set()  # every id accepted, never reused (a str in a set: ~100 bytes each)
        self.scheduler = Scheduler(config, self.kv_store, self._make_room_for_kv, expert_floor, self._preempt)
        self.prefix = PrefixCache(
            self.kv_store,
            config.is_prefix_reused,
            lambda: self.scheduler.step_id,
            config.prefix_spill_cap_bytes,
            config.prefix_ram_cap_bytes,
        )
        self.scheduler.adopt = self.prefix.adopt
        uses = self.step_uses = StepUses()  # what the step used, and the measured decode compute time
        self._view = LiveView(
            self.expert_store, self.kv_store, config.profile, self.sequences, self.scheduler, uses, self.io, self.prefix
        )
        self._attach_executor(loaded, model, shape, uses)
        self.finished: dict[str, RequestOutput] = {}
        self.failed: dict[str, tuple[RequestOutput, str]] = {}  # ended by a fault only they met: output, why
        self.modeled_clock_s = 0.0
        self.is_observe = config.is_observe
        self.last_plan: StepPlan | None = None  # plan of the latest step, for recorders
        self.is_capturing = False  # fill StepResult.capture with every access of each step (a trace recorder)

    def _attach_stores(self, config: EngineConfig, loaded: LoadedCheckpoint, shape: KVShape) -> tuple[int, Budgets]:
        """The dense weights' size, the one I/O queue, and the expert and KV stores on it; returns the expert
        floor and the budgets."""
        dense = [
            p
            for n, p in loaded.model.named_parameters()
            if not n.endswith(("experts.gate_up_proj", "experts.down_proj"))
        ]
        self.num_dense_params = sum(p.numel() for p in dense)  # resident, outside the device budget
        self.num_dense_bytes = sum(p.numel() * p.element_size() for p in dense)
        self.io = IOScheduler(num_workers=max(1, config.num_io_threads or 0))  # the disk's one queue (workers
        # start on first use): expert reads from the checkpoint and KV spill reads and writes all go through it
        loaded.reader.files.io = self.io
        self.expert_store, self.kv_store, expert_floor, budgets = build_stores(
            config, loaded, shape, self.device, self.num_dense_bytes
        )
        self.kv_store.spill.attach_io(self.io)
        if self.expert_store.lowbit_cache is not None:  # persisted low-bit copies are read on the same queue
            self.expert_store.lowbit_cache.io = self.io
        self.budget_note = budgets.note  # how the budgets were set (given, sized from memory, emulated)
        self.tier_layout = self.expert_store.layout
        return expert_floor, budgets

    def _attach_executor(
        self, loaded: LoadedCheckpoint, model: torch.nn.Module, shape: KVShape, uses: StepUses
    ) -> None:
        """The executor that computes routed experts and paged attention over the stores, hooked into the model's
        experts and attention modules, and the runner of the model's packed forwards."""
        first = next(iter(loaded.experts_by_layer.values()))
        self.executor = Executor(
            self.expert_store,
            self.kv_store,
            self.controller,
            self.config.profile,
            view=self._view,
            uses=uses,
            hidden_size=int(self.model_config.hidden_size),
            intermediate_size=int(first.intermediate_dim),
            routers=find_routers(model, loaded.experts_by_layer),
            top_k=loaded.top_k,
            audit_cache_bytes=self.config.audit_cache_bytes,
        )
        paged_attention.attach(model, self.executor)
        self.kv_store.expand_bytes_per_token = paged_attention.expand_bytes_per_token(model, self.kv_store.dtype)
        for layer, module in loaded.experts_by_layer.items():
            module._fg_executor, module._fg_layer = self.executor, layer
        heads = int(self.model_config.num_attention_heads)
        attn_flops = 4.0 * heads * (shape.key_dim + shape.value_dim) / 2 * shape.num_layers
        self.runner = ModelRunner(
            model, self.executor, shape.num_layers, self.device, 2.0 * self.num_dense_params, attn_flops
        )
        if self.config.is_decode_compiled:
            self.runner.compiled = CompiledDecode(model, self.executor, loaded.experts_by_layer)

    @property
    def dtype_name(self) -> str:
        """The compute dtype as a config and the ledger spell it ("bfloat16")."""
        return str(self.dtype).removeprefix("torch.")

    # --- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        request_class: str = "default",
        num_scored_tokens: int = 0,
        is_logits_kept: bool = True,
        arrival_s: float | None = None,
        session_id: str | None = None,
    ) -> str:
        """Queue a request; returns its id (default: ``req-<n>`` for the n-th request accepted).

        `arrival_s`: when the request arrived (``time.perf_counter``; default: now), what its TTFT counts from.
        `session_id`: the client's session (a multi-turn conversation) the request belongs to; a later turn may
        continue its text, so the blocks it leaves as kept prefixes are marked as a session's.

        `num_scored_tokens` = k > 0 keeps the prefill logits of the last k prompt positions; they come back as
        `RequestOutput.prompt_logits` [k, vocab] (teacher-forced scoring through the engine's own path).
        `is_logits_kept` False: the full logits of its output tokens are dropped when it ends (`output_logits`
        None; only what sampling itself reports, ``SamplingParams.num_top_logprobs``) unless it read a KV block
        anywhere but on device (such requests are audited by risk); servers keep them for audited requests.
        """
        params = params or SamplingParams()
        request_id = request_id or f"req-{self.num_added}"
        self.check_request(prompt_token_ids, params, request_id, num_scored_tokens)
        seed = params.seed if params.seed is not None else self.config.seed + self.num_added
        seq = requests.new_sequence(
            prompt_token_ids,
            params,
            request_id,
            request_class,
            num_scored_tokens,
            is_logits_kept,
            arrival_s,
            self.modeled_clock_s,
            seed,
        )
        seq.session_id = session_id
        self.scheduler.add(seq)  # refuses a request that could never fit on device
        self.sequences[request_id] = seq
        self._used_ids.add(request_id)
        self.num_added += 1
        return request_id

    def check_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, num_scored_tokens: int = 0
    ) -> None:
        """Raise PromptError for a request this engine would refuse (callers check before recording)."""
        config, used = self.config, self._used_ids
        requests.check_request(config, self.model_config, used, prompt_token_ids, params, request_id, num_scored_tokens)

    @property
    def max_model_len(self) -> int:
        """Tokens per request the engine accepts: the configured max_model_len capped by the model's positions."""
        return requests.max_model_len(self.config, self.model_config)

    @property
    def length_limit_reason(self) -> str:
        """Where `max_model_len` comes from, for messages ("min(max_model_len 4096, max_position_embeddings 1024)")."""
        return requests.length_limit_reason(self.config, self.model_config)

    def close(self) -> None:
        """Stop the expert read threads, release the host room of reads in flight and remove the spill
        directory (the engine serves no more afterwards)."""
        self.expert_store.close()
        if self.runner.compiled is not None:
            self.runner.compiled.close()
        self.kv_store.close()
        self.io.close()
        self.expert_store.reader.files.io = None  # an audit after close reads the checkpoint in its own thread
        if self.expert_store.lowbit_cache is not None:
            self.expert_store.lowbit_cache.io = None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def partial_output(self, request_id: str) -> RequestOutput:
        """What the unfinished request `request_id` has produced so far (tokens, timings up to now, tag counts),
        to record it as cancelled; the request itself is left as it is."""
        seq = self.sequences[request_id]
        seq.finish_s, seq.modeled_finish_s = time.perf_counter(), self.modeled_clock_s
        return request_output(seq)

    def abort_request(self, request_id: str, is_kept: bool = True) -> RequestOutput:
        """End the unfinished request `request_id` now, between steps (its client went away, its time ran out):
        it leaves the scheduler, its exact full KV blocks are kept for later prefixes as on finish (`is_kept`
        False, a request that met a fault: none), every other copy is freed; returns what it had produced."""
        output = self.partial_output(request_id)
        seq = self.sequences.pop(request_id)
        self.scheduler.abort(seq)
        self.prefix.release(seq, is_aborted=True, is_kept=is_kept)
        return output

    # --- memory pressure -----------------------------------------------------------------------
    def _make_room_for_kv(
        self, num_bytes: int, pinned: Container[KVBlockKey], is_done: Callable[[], bool], is_kv_only: bool
    ) -> bool:
        return make_room_for_kv(self.executor, num_bytes, pinned, is_done, is_kv_only)

    def _preempt(self, seq: Sequence) -> None:
        if self.config.preempt_mode != PreemptMode.SWAP.value:  # its KV is dropped: the exact full blocks are kept
            self.prefix.keep_blocks(seq, is_aborted=True)
        preempt(self.config.preempt_mode, self.kv_store, self.executor, seq)

    def view(self) -> ControllerView:
        """The read-only view of the engine's state that controllers are shown."""
        return self._view

    # --- conveniences --------------------------------------------------------------------------
    def generate(
        self, prompts: Iterable[list[int]], params: SamplingParams | None = None, is_progress_shown: bool = False
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order (taken from `finished`)."""
        ids = [self.add_request(p, params) for p in prompts]
        total = sum(self.sequences[i].params.max_new_tokens for i in ids)
        with tqdm(total=total, disable=not is_progress_shown, unit="tok") as bar:
            while self.has_unfinished():
                result = self.step()
                bar.update(len(result.sampled_token_ids))
        failed = [f"{i}: {self.failed[i][1]}" for i in ids if i in self.failed]
        if failed:
            raise EngineError(f"{len(failed)} of {len(ids)} requests failed: {'; '.join(failed)}")
        return [self.finished.pop(i) for i in ids]

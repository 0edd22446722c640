"""Run a batch of prompts through an engine, with a progress bar; the settings a run is assembled from."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection
from typing import Any

import torch
from tqdm.auto import tqdm

from fallbackgate.audit.completeness import CHECKPOINT_READ
from fallbackgate.batch.prompts import PromptSpec
from fallbackgate.engine import heap
from fallbackgate.engine.config import PreemptMode
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.experts.quant import quantize
from fallbackgate.engine.kv.codec import quantize_kv
from fallbackgate.engine.messages import RequestOutput, StepPlan, StepResult
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.engine.tags import ObjectKind, Tag, Tier
from fallbackgate.profiling.names import MEASURED


@dataclasses.dataclass(kw_only=True, slots=True)
class RunSettings:
    """What a user chose on the command line or in a policy file."""

    model_dir: str
    max_new_tokens: int = 32
    seed: int = 0
    temperature: float = 0.0
    device_budget_mb: float | None = None
    host_budget_mb: float | None = None
    spill_dir: str | None = None
    block_size: int = 16
    max_num_seqs: int = 8
    profile: str = MEASURED  # "measured" (this machine) or a shipped what-if profile name
    preempt_mode: str = PreemptMode.SWAP.value
    max_num_batched_tokens: int = 256  # tokens per forward (prefill chunk size)
    dtype: str | None = None  # compute dtype override; None: the checkpoint's own
    is_stacked_when_fits: bool = True  # False when tags are forced: they act on misses, which stacking removes
    num_io_threads: int | None = None  # threads reading experts ahead of use (None: the engine's default)
    audit_cache_mb: float = 256.0  # the audit's own verified expert copies, outside the budgets


@dataclasses.dataclass(slots=True)
class RunOutcome:
    """Everything a run produced, in prompt order."""

    specs: list[PromptSpec]
    outputs: list[RequestOutput]
    texts: list[str]
    steps: list[StepResult]
    wall_s: float
    memory: dict[str, Any] = dataclasses.field(default_factory=dict)  # byte counts and dtype, `memory_summary`
    profile_name: str = ""  # the hardware profile the run predicted (and modeled what-if times) with
    failures: dict[str, str] = dataclasses.field(default_factory=dict)  # request id -> why it failed (a fault
    # only it met: a quarantined expert it may not defer, an unreadable KV block it may not recompute)


StepHook = Callable[[StepPlan, StepResult], None]


def run_prompts(
    engine: Engine,
    specs: list[PromptSpec],
    settings: RunSettings,
    on_step: StepHook | None = None,
    is_progress_shown: bool = True,
    logits_kept_ids: Collection[str] | None = None,
) -> RunOutcome:
    """Submit every prompt at its arrival time, step the engine until all finish, decode the outputs.

    A prompt with ``arrival_s`` is submitted once the wall clock since the run's start reaches it (the engine
    idles, sleeping, while nothing is due and nothing runs); one without arrives at the start. Its TTFT counts
    from its arrival, so a request that arrives during a step waits for it on its own clock. Outputs come back
    in prompt order. ``logits_kept_ids``: the requests whose full output logits are kept (those to be audited);
    None: all.
    """
    stop_ids = tuple(i for i in (engine.tokenizer.eos_token_id,) if i is not None)
    due = sorted(specs, key=lambda spec: spec.arrival_s or 0.0)  # stable: equal arrivals keep file order
    total = sum(spec.max_new_tokens or settings.max_new_tokens for spec in specs)
    steps: list[StepResult] = []
    num_submitted = 0
    with heap.frozen_while_serving():  # no full collection inside a step (collected once before the clock starts)
        started = time.perf_counter()
        with tqdm(total=total, disable=not is_progress_shown, unit="tok", desc="decoding") as bar:
            while num_submitted < len(due) or engine.has_unfinished():
                now = time.perf_counter()
                while num_submitted < len(due) and (arrival := started + (due[num_submitted].arrival_s or 0.0)) <= now:
                    _submit(engine, due[num_submitted], settings, stop_ids, logits_kept_ids, arrival)
                    num_submitted += 1
                if not engine.has_unfinished():  # idle until the next arrival
                    time.sleep(max(0.0, started + (due[num_submitted].arrival_s or 0.0) - time.perf_counter()))
                    continue
                result = engine.step()
                steps.append(result)
                if on_step is not None:
                    on_step(engine.last_plan, result)
                bar.update(len(result.sampled_token_ids))
    failed = {s.request_id: engine.failed.pop(s.request_id) for s in specs if s.request_id in engine.failed}
    failures = {rid: why for rid, (_, why) in failed.items()}
    # a failed request's output is what it had produced when it failed
    outputs = [failed[s.request_id][0] if s.request_id in failed else engine.finished.pop(s.request_id) for s in specs]
    texts = [engine.tokenizer.decode(o.output_token_ids, skip_special_tokens=True) for o in outputs]
    wall_s = time.perf_counter() - started
    memory, profile = memory_summary(engine), engine.config.profile.name
    return RunOutcome(specs, outputs, texts, steps, wall_s, memory, profile, failures)


def _submit(
    engine: Engine,
    spec: PromptSpec,
    settings: RunSettings,
    stop_ids: tuple[int, ...],
    logits_kept_ids: Collection[str] | None,
    arrival: float,
) -> None:
    """Tokenize ``spec`` and add it to the engine as having arrived at ``arrival`` (``time.perf_counter``)."""
    params = SamplingParams(
        max_new_tokens=spec.max_new_tokens or settings.max_new_tokens,
        temperature=settings.temperature,
        stop_token_ids=stop_ids,
    )
    is_kept = logits_kept_ids is None or spec.request_id in logits_kept_ids
    token_ids = engine.tokenizer.encode(spec.prompt)
    engine.add_request(
        token_ids,
        params,
        spec.request_id,
        spec.request_class,
        is_logits_kept=is_kept,
        arrival_s=arrival,
        session_id=spec.session,
    )


def memory_summary(engine: Engine) -> dict[str, Any]:
    """What the device budget counts (expert slots, KV blocks, staged and gathered KV, dequantized expert
    scratch; peaks in total and by kind) and what stays resident outside it (dense weights)."""
    experts = engine.expert_store
    return {
        "tier_layout": engine.tier_layout.value,
        "budget_note": engine.budget_note,
        "device_budget_bytes": engine.kv_store.device_pool.budget_bytes,
        "host_budget_bytes": engine.kv_store.host_pool.budget_bytes,
        "dense_bytes": engine.num_dense_bytes,
        "expert_bytes_total": experts.bytes_per_expert * len(experts.entries),
        "bytes_per_expert": experts.bytes_per_expert,
        "bytes_per_kv_block": engine.kv_store.bytes_per_block,
        # experts whose only full-precision copy is the checkpoint: not resident, not cached on the host
        "num_experts_on_disk": sum(
            1 for key in experts.entries if experts.home(key) is Tier.DISK and not experts.is_on_device(key)
        ),
        "peak_device_pool_bytes": engine.kv_store.device_pool.peak_used_bytes,
        "peak_device_pool_bytes_by_kind": {
            kind.value: peak for kind, peak in engine.kv_store.device_pool.peak_bytes_by_kind.items()
        },
        "peak_host_pool_bytes": engine.kv_store.host_pool.peak_used_bytes,
        "num_expert_disk_reads": experts.num_disk_reads,
        "checkpoint_bytes_read": experts.reader.files.num_bytes_read,  # every expert read, verifications too
        "dtype": engine.dtype_name,
        "block_size": engine.config.block_size,
        "object_bytes": object_bytes(engine),
        "routing": routing(engine),
        # KV copy changes the engine handed out with its step results (the kv_copies rows' blocks add up to it)
        "num_kv_copy_changes": engine.kv_store.num_copy_changes - len(engine.kv_store.copy_changes),
        "prefix_reuse": engine.prefix.summary(),  # kept and reused prefix blocks (engine/kv/prefix_cache.py)
    }


def routing(engine: Engine) -> dict[str, Any]:
    """Experts per token and routed experts per MoE layer: what the audit checks each request's expert uses
    per layer against (a decode token uses exactly ``top_k`` experts of every MoE layer)."""
    per_layer: dict[int, int] = {}
    for layer, _ in engine.expert_store.entries:
        per_layer[layer] = per_layer.get(layer, 0) + 1
    return {"top_k": engine.executor.top_k, "experts_per_layer": {str(k): n for k, n in sorted(per_layer.items())}}


def object_bytes(engine: Engine) -> dict[str, Any]:
    """Bytes one object moves with each tag: a full expert (in the compute dtype, and as one read from the
    checkpoint takes it), its low-bit copy per bits, a KV block and its quantized copy per bits (what the
    gate checks each event's bytes against)."""
    experts, kv = engine.expert_store, engine.kv_store
    sample = experts.reader.read(next(iter(experts.entries)))
    block = torch.zeros(kv.block_shape, dtype=kv.dtype)
    lowbit = {}
    if experts.lowbit_bits:
        bits = experts.lowbit_bits
        lowbit[str(bits)] = sum(quantize(t, bits, axis=1).num_bytes for t in (sample.gate_up, sample.down))
    return {
        ObjectKind.EXPERT.value: experts.bytes_per_expert,
        CHECKPOINT_READ: experts.checkpoint_bytes_per_expert,
        Tag.EXPERT_LOWBIT.value: lowbit,
        ObjectKind.KV_BLOCK.value: kv.bytes_per_block,
        Tag.KV_DEQUANT.value: {str(bits): quantize_kv(block, bits, kv.key_dim).num_bytes for bits in (8, 4)},
    }

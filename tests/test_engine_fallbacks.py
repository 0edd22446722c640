"""Every fallback is a real computation: approximate tags move the logits, equivalent ones barely."""

from __future__ import annotations

import pytest

from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.device_pool import HeldCopy
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.sequence import SamplingParams
from tests.test_engine_exact import NEW_TOKENS, _prompts, reference, sizes


def _run(path, force=(), **knobs):
    if "cpu_execute" in force:  # a GPU machine's tag: on a CPU only under the test-only tier emulation
        knobs["is_emulated_device_tier"] = True
    engine = Engine(EngineConfig(model_dir=str(path), block_size=4, max_num_seqs=3, **knobs), ExactLRUController(force))
    outputs = engine.generate(_prompts(1), SamplingParams(max_new_tokens=NEW_TOKENS))
    return engine, outputs


def _max_teacher_forced_diff(engine: Engine, outputs, reduce: str = "max") -> float:
    """Largest (or mean) |engine − exact| logit over generated positions (teacher-forced on engine tokens)."""
    values = []
    for out in outputs:
        exact = engine.exact_logits(out.prompt_token_ids + out.output_token_ids[:-1])[len(out.prompt_token_ids) - 1 :]
        delta = (out.output_logits - exact).abs()
        values.append(delta.max().item() if reduce == "max" else delta.mean().item())
    return max(values) if reduce == "max" else sum(values) / len(values)


def _tags(outputs) -> dict[str, int]:
    tags: dict[str, int] = {}
    for out in outputs:
        for tag, count in out.tag_counts.items():
            tags[tag] = tags.get(tag, 0) + count
    return tags


@pytest.mark.parametrize(
    ("force", "low", "high"),
    [
        ("expert_defer", 1e-2, float("inf")),
        ("expert_lowbit", 1e-4, 1.0),
        ("kv_dequant", 1e-4, 1.0),
        ("cpu_execute", 0.0, 1e-4),
        ("recompute", 0.0, 1e-4),
    ],
)
def test_forced_tag_is_real(force: str, low: float, high: float, checkpoint_factory) -> None:
    path = checkpoint_factory("qwen3_moe")
    expert, block, layers, top_k = sizes(path)
    budget = 4 * expert + 12 * layers * block
    engine, outputs = _run(path, [force], device_budget_bytes=budget)
    tags = _tags(outputs)
    assert tags.get(force, 0) > 10, tags
    diff = _max_teacher_forced_diff(engine, outputs)
    assert low < diff < high, f"{force}: max |Δlogit| {diff:.3g} outside ({low}, {high})"


def test_int4_kv_moves_logits_more_than_int8(checkpoint_factory) -> None:
    path = checkpoint_factory("qwen3_moe")
    diffs = {}
    for bits in (8, 4):
        engine = Engine(
            # host-quantized KV copies: CUDA's layout, emulated (on a CPU's RAM tier an int4 spill goes to disk
            # as int8 until quantized KV blocks live in the RAM pool)
            EngineConfig(model_dir=str(path), block_size=4, max_num_seqs=3, is_emulated_device_tier=True),
            ExactLRUController(["kv_dequant"], kv_quant_bits=bits),
        )
        outputs = engine.generate(_prompts(1), SamplingParams(max_new_tokens=NEW_TOKENS))
        diffs[bits] = _max_teacher_forced_diff(engine, outputs, reduce="mean")
    assert diffs[4] > 2 * diffs[8] > 0, diffs


def test_budget_below_minimum_is_refused_with_the_minimum(checkpoint_factory) -> None:
    path = checkpoint_factory("qwen3_moe")
    expert, block, layers, top_k = sizes(path)
    minimum = top_k * expert + layers * block
    from fallbackgate.engine.errors import BudgetError

    with pytest.raises(BudgetError, match=f"minimum is {minimum / 2**20:.3f} MiB"):
        Engine(EngineConfig(model_dir=str(path), block_size=4, device_budget_bytes=minimum - 1), ExactLRUController())
    Engine(EngineConfig(model_dir=str(path), block_size=4, device_budget_bytes=minimum), ExactLRUController())


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_resumes_exactly(mode: str, checkpoint_factory) -> None:
    path = checkpoint_factory("mixtral")
    prompts = _prompts(1)
    ref_tokens, _ = reference(path, prompts)
    engine = Engine(
        EngineConfig(model_dir=str(path), block_size=4, max_num_seqs=4, preempt_mode=mode), ExactLRUController()
    )
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=NEW_TOKENS)) for p in prompts]
    victim = engine.sequences[ids[1]]
    for _ in range(2):  # twice: a block restored once must not come back stale the second time
        for _ in range(4):
            engine.step()
        engine.scheduler.preempt(victim)
    while engine.has_unfinished():
        engine.step()
    outputs = [engine.finished[i] for i in ids]
    assert [o.output_token_ids for o in outputs] == ref_tokens
    assert outputs[1].num_preemptions == 2
    if mode == "recompute":
        assert outputs[1].tag_counts.get("recompute", 0) >= 3  # every layer's rebuilt blocks
    else:
        assert outputs[1].tag_counts.get("exact_load", 0) > 0


def test_seeded_sampling_is_reproducible(checkpoint_factory) -> None:
    path = checkpoint_factory("olmoe")
    runs = []
    for seed in (7, 7, 8):
        engine = Engine(EngineConfig(model_dir=str(path), block_size=4), ExactLRUController())
        outs = engine.generate(_prompts(2), SamplingParams(max_new_tokens=10, temperature=1.0, seed=seed))
        runs.append([o.output_token_ids for o in outs])
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_device_accounting_is_byte_accurate(checkpoint_factory) -> None:
    path = checkpoint_factory("qwen3_moe")
    expert, block, layers, top_k = sizes(path)
    engine = Engine(
        EngineConfig(model_dir=str(path), block_size=4, device_budget_bytes=6 * expert + 20 * layers * block),
        ExactLRUController(),
    )
    engine.add_request(_prompts(1)[1], SamplingParams(max_new_tokens=4))
    while engine.has_unfinished():
        result = engine.step()
        pool = engine.kv_store.device_pool
        kept_lowbit = pool.used_bytes_by_kind[HeldCopy.EXPERT_LOWBIT]
        assert result.num_device_bytes_expert == len(engine.expert_store.device_keys()) * expert + kept_lowbit
        assert pool.used_bytes <= pool.budget_bytes
        kv_blocks = len(engine.kv_store.device_blocks())
        assert result.num_device_bytes_kv == kv_blocks * block


@pytest.mark.parametrize("force", ["expert_defer", "expert_lowbit", "kv_dequant", "expert_defer+kv_dequant"])
def test_observe_mode_records_the_choice_but_serves_exactly(force: str, checkpoint_factory) -> None:
    path = checkpoint_factory("qwen3_moe")
    expert, block, layers, top_k = sizes(path)
    engine = Engine(
        EngineConfig(
            model_dir=str(path),
            block_size=4,
            max_num_seqs=3,
            device_budget_bytes=4 * expert + 12 * layers * block,
            is_observe=True,
        ),
        ExactLRUController(force.split("+")),
    )
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=NEW_TOKENS)) for p in _prompts(1)]
    notes: list[str] = []
    while engine.has_unfinished():
        notes += [e.note for e in engine.step().events if "observe" in e.note]
    outputs = [engine.finished[i] for i in ids]
    assert not set(_tags(outputs)) & {"expert_defer", "expert_lowbit", "kv_dequant"}
    assert notes and all(any(n.endswith(f"observe: would serve {t}") for t in force.split("+")) for n in notes)
    assert _max_teacher_forced_diff(engine, outputs) < 1e-4  # exact (kv_dequant: rebuilt by recompute)

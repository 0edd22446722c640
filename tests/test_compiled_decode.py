"""Decode forwards compiled whole (``hardware.compile_decode``): the engine's K/V update, attention and experts
run inside the graph as custom operators, so they decide, serve and record exactly as eagerly.

- exact, everything in memory: the eager engine's tokens, logits within fp32 noise, every decode forward
  compiled, the engine's experts function called as often;
- under a budget that misses: the same tokens and the same fallback tags per request as the eager engine
  under the same budget and schedule (misses decided inside the compiled forward);
- the same on every architecture the operators cover (random Qwen3-MoE, Mixtral, OLMoE checkpoints); MLA models
  refused with their reason;
- what an engine function raises inside the compiled forward comes out with its own type and message;
- engines built one after another each get their own graphs, past dynamo's default limit of 8 per code.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

from fallbackgate.assembly import Overrides
from fallbackgate.bench.decode import _prompts
from fallbackgate.bench.engines import exact_assembly
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.errors import EngineError
from fallbackgate.engine.model.compiled import CompiledDecode
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.tinymoe import CHECKPOINT_DIR
from tests.checkpoints import ARCHITECTURES, make_checkpoint

NEW_TOKENS = 6


def _engines(overrides: Overrides | None, max_num_seqs: int) -> tuple[Engine, Engine]:
    eager, compiled = (
        exact_assembly(str(CHECKPOINT_DIR), overrides, max_num_seqs=max_num_seqs, compile_decode=is_compiled).engine
        for is_compiled in (False, True)
    )
    return eager, compiled


def _count_experts_calls(engine: Engine) -> list[int]:
    """Every call of `engine`'s experts function appends its layer to the returned list."""
    executor = engine.runner.executor
    run, calls = executor.run_experts, []

    def counted(module, layer, *args):
        calls.append(layer)
        return run(module, layer, *args)

    executor.run_experts = counted
    return calls


@pytest.mark.slow
def test_compiled_decode_gives_the_eager_engines_tokens_through_the_engines_own_functions() -> None:
    prompts = _prompts(4096, 2, 12, 3)
    eager, compiled = _engines(None, 1)
    calls = [_count_experts_calls(eager), _count_experts_calls(compiled)]
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    expected, outputs = eager.generate(prompts, params), compiled.generate(prompts, params)
    assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in expected]
    for got, want in zip(outputs, expected, strict=True):
        assert torch.allclose(got.output_logits, want.output_logits, atol=1e-4, rtol=0)
        assert got.tag_counts == want.tag_counts
    assert compiled.runner.compiled.num_forwards == len(prompts) * (NEW_TOKENS - 1)  # every decode, no prefill
    assert len(calls[1]) == len(calls[0]) == 4 * NEW_TOKENS * len(prompts)  # 4 MoE layers a forward


@pytest.mark.slow
def test_misses_under_a_budget_are_decided_and_recorded_inside_the_compiled_forward() -> None:
    prompts = _prompts(4096, 3, 10, 5)
    budget = Overrides(device_budget_bytes=6 * 1024 * 1024, max_new_tokens=NEW_TOKENS)  # ~20 of 64 experts
    eager, compiled = _engines(budget, 2)
    dispatch, decode_misses = compiled.runner.executor.dispatch, []
    run_with_misses = dispatch._run_with_misses

    def counted(*args):
        decode_misses.append(CompiledDecode.takes(dispatch.ctx.batch, is_rebuild_pass=False))
        return run_with_misses(*args)

    dispatch._run_with_misses = counted
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    expected, outputs = eager.generate(prompts, params), compiled.generate(prompts, params)
    assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in expected]
    assert [o.tag_counts for o in outputs] == [o.tag_counts for o in expected]
    assert sum(o.tag_counts.get("exact_load", 0) for o in outputs) > 0
    assert compiled.runner.compiled.num_forwards > 0 and sum(decode_misses) >= 5  # layers missing in decodes


def test_a_model_whose_attention_the_operators_do_not_cover_is_refused_with_its_reason() -> None:
    class Attention(torch.nn.Module):
        layer_idx, scaling, sliding_window = 0, 1.0, 128

    model = torch.nn.Sequential(Attention())
    with pytest.raises(EngineError, match="sliding window"):
        CompiledDecode(model, object(), {})  # type: ignore[arg-type]


@pytest.mark.slow
def test_two_compiled_engines_in_one_process_each_run_their_own_engine() -> None:
    """Graphs bake in their engine's handle; an engine built later (same model class) gets its own graph."""
    prompts = _prompts(4096, 2, 10, 7)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    budget = Overrides(device_budget_bytes=6 * 1024 * 1024, max_new_tokens=NEW_TOKENS)
    roomy = exact_assembly(str(CHECKPOINT_DIR), max_num_seqs=1, compile_decode=True).engine
    tight = exact_assembly(str(CHECKPOINT_DIR), budget, max_num_seqs=1, compile_decode=True).engine
    first, missed = roomy.generate(prompts, params), tight.generate(prompts, params)
    again = roomy.generate(prompts, params)
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in first]
    assert not any(o.tag_counts.get("exact_load") for o in first + again)
    assert sum(o.tag_counts.get("exact_load", 0) for o in missed) > 0
    assert roomy.runner.compiled.handle != tight.runner.compiled.handle
    assert roomy.runner.compiled.num_forwards == 2 * tight.runner.compiled.num_forwards > 0  # every decode compiled


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_covered_architecture_decodes_compiled_as_eagerly(arch: str, tmp_path: pathlib.Path) -> None:
    path = str(make_checkpoint(arch, tmp_path / arch))
    prompts, params = [[5, 17, 33, 9, 101, 250, 7], [44, 2, 190, 31]], SamplingParams(max_new_tokens=NEW_TOKENS)
    eager = exact_assembly(path, max_num_seqs=2).engine
    if arch.startswith("deepseek"):  # MLA: the eager attention function expands latents per request
        with pytest.raises(EngineError, match="MLA"):
            exact_assembly(path, max_num_seqs=2, compile_decode=True)
        return
    compiled = exact_assembly(path, max_num_seqs=2, compile_decode=True).engine
    expected, outputs = eager.generate(prompts, params), compiled.generate(prompts, params)
    assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in expected]
    for got, want in zip(outputs, expected, strict=True):
        assert torch.allclose(got.output_logits, want.output_logits, atol=1e-4, rtol=0)
    assert compiled.runner.compiled.num_forwards == NEW_TOKENS - 1


@pytest.mark.slow
def test_an_engine_error_inside_the_compiled_forward_comes_out_as_raised() -> None:
    engine = exact_assembly(str(CHECKPOINT_DIR), max_num_seqs=1, compile_decode=True).engine
    executor, calls = engine.runner.executor, []
    run = executor.run_experts

    def failing(module, layer, *args):
        calls.append(layer)
        if len(calls) == 4 * 3 + 2:  # the second decode forward's second MoE layer
            raise EngineError("planted: spill directory full")
        return run(module, layer, *args)

    executor.run_experts = failing
    with pytest.raises(EngineError, match="planted: spill directory full"):
        engine.generate([[5, 17, 33, 9]], SamplingParams(max_new_tokens=NEW_TOKENS))
    assert len(calls) == 4 * 3 + 2  # the layers after it did no engine work


@pytest.mark.slow
def test_engines_built_one_after_another_each_compile_their_own_graphs(tmp_path: pathlib.Path) -> None:
    path = str(make_checkpoint("olmoe", tmp_path / "olmoe"))
    params = SamplingParams(max_new_tokens=3)
    expected = exact_assembly(path, max_num_seqs=3).engine.generate([[5, 17, 33], [9, 4], [8]], params)
    for _ in range(9):  # two graphs each (batch 3, then 1)
        engine = exact_assembly(path, max_num_seqs=3, compile_decode=True).engine
        outputs = engine.generate([[5, 17, 33], [9, 4], [8]], params)
        assert [o.output_token_ids for o in outputs] == [o.output_token_ids for o in expected]
        engine.close()

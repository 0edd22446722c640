"""The compiled-layers experiment of ``fallbackgate.bench.decode_compiled``: compiling the decoder layers with
the engine's functions as graph breaks changes no token, and the engine's functions still run (the ledger's
view of the step is the same)."""

from __future__ import annotations

import pytest

from fallbackgate.bench.decode import _prompts, engine_assembly, run_engine
from fallbackgate.bench.decode_compiled import compile_layers
from fallbackgate.tinymoe import CHECKPOINT_DIR


@pytest.mark.slow
def test_compiled_layers_give_the_eager_engines_tokens_through_the_engines_own_functions() -> None:
    prompts = _prompts(4096, 2, 12, 3)
    eager, compiled = (engine_assembly(str(CHECKPOINT_DIR), 1).engine for _ in range(2))
    calls = [_count_experts_calls(eager), _count_experts_calls(compiled)]
    compile_layers(compiled)
    _, expected = run_engine(eager, prompts, 6)
    _, tokens = run_engine(compiled, prompts, 6)
    assert tokens == expected and all(len(t) == 6 for t in tokens)
    assert len(calls[1]) == len(calls[0]) >= 4 * 6 * len(prompts)  # 4 MoE layers a forward


def _count_experts_calls(engine) -> list[int]:
    """Every call of `engine`'s experts function appends its layer to the returned list."""
    executor = engine.runner.executor
    run, calls = executor.run_experts, []

    def counted(module, layer, *args):
        calls.append(layer)
        return run(module, layer, *args)

    executor.run_experts = counted
    return calls

"""python -m fallbackgate.bench.decode_compiled --json bench-decode-compiled.json

Would ``torch.compile`` give the engine a faster forward? The engine at batch 1 against transformers'
generate() (as ``fallbackgate.bench.decode``), with a third side: the same engine whose decoder layers are
compiled by ``torch.compile`` (inductor, dynamic shapes), the engine's own experts, attention and K/V-store
functions left eager — each a graph break, since they decide misses, read the paged store and record — and
registered under their own names on that engine's model only, so the other two sides run unchanged. The
compiled engine is warmed up (compiled) before any timing, and its compile seconds are reported apart.
Sides are interleaved over the repeats; medians, every run, ratios and whether tokens match go to JSON.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import torch
from transformers import AttentionInterface
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from fallbackgate.bench.decode import bench_generate, decode_setup, engine_assembly, run_engine
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.experts.hook import fallbackgate_experts_forward
from fallbackgate.engine.kv.paged_attention import paged_attention_forward

COMPILED_NAME = "fallbackgate_eager_in_compiled"  # the engine's functions, registered as graph breaks


def compile_layers(engine: Engine) -> None:
    """Compile every decoder layer of `engine`'s model; the engine's functions stay eager (graph breaks)."""
    ALL_EXPERTS_FUNCTIONS.register(COMPILED_NAME, torch.compiler.disable(fallbackgate_experts_forward))
    AttentionInterface.register(COMPILED_NAME, torch.compiler.disable(paged_attention_forward))
    model = engine.runner.model
    model.config._attn_implementation = COMPILED_NAME
    model.config._experts_implementation = COMPILED_NAME
    for layer in engine.runner.cache.layers:
        layer.update = torch.compiler.disable(layer.update)
    torch._dynamo.config.allow_unspec_int_on_nn_module = True  # one graph for every layer index
    torch._dynamo.config.recompile_limit = 64
    for layer in model.model.layers:
        layer.forward = torch.compile(layer.forward, dynamic=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="bench-decode-compiled.json")
    args, reference, prompts = decode_setup(parser)
    eager, compiled = (engine_assembly(args.model, 1).engine for _ in range(2))
    compile_layers(compiled)
    started = time.perf_counter()
    for _ in range(2):  # prefill and decode shapes, then the dynamic-shape recompiles
        run_engine(compiled, prompts, args.new_tokens)
    compile_s = time.perf_counter() - started
    sides = {
        "generate": lambda: bench_generate(reference, prompts, args.new_tokens, 1),
        "engine": lambda: run_engine(eager, prompts, args.new_tokens),
        "engine_compiled": lambda: run_engine(compiled, prompts, args.new_tokens),
    }
    runs: dict[str, list[float]] = {side: [] for side in sides}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(args.repeats):
        for side, bench in sides.items():
            rate, tokens[side] = bench()
            runs[side].append(rate)
    medians = {side: statistics.median(rates) for side, rates in runs.items()}
    result = {
        "model": args.model,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "num_prompts": args.num_prompts,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "compile_and_warmup_s": compile_s,
        "tokens_per_s": medians,
        "all_runs": runs,
        "ratios": {
            f"{side}_vs_generate": medians[side] / medians["generate"] for side in ("engine", "engine_compiled")
        },
        "tokens_equal": {side: tokens[side] == tokens["generate"] for side in ("engine", "engine_compiled")},
    }
    print(
        json.dumps({k: result[k] for k in ("compile_and_warmup_s", "tokens_per_s", "ratios", "tokens_equal")}, indent=2)
    )
    pathlib.Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

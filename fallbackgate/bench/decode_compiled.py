"""python -m fallbackgate.bench.decode_compiled --json bench-decode-compiled.json

Does compiling the decode forward give the engine a faster forward? The engine at batch 1 against transformers'
generate() (as ``fallbackgate.bench.decode``), with a third side: the same engine with ``hardware.compile_decode``
(engine/model/compiled.py) — every decode forward one ``torch.compile`` graph of the model's own modules, the
engine's K/V update, attention and experts called inside it as custom operators (they decide, serve and record
as eagerly). The compiled engine is warmed up (compiled) before any timing, and its compile seconds are reported
apart. Sides are interleaved over the repeats, their order rotated each repeat (a side run right after the eager
engine's measured slower here); medians, every run, ratios and whether tokens match go to JSON.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import torch

from fallbackgate.bench.decode import bench_generate, decode_setup, run_engine
from fallbackgate.bench.engines import exact_assembly


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="bench-decode-compiled.json")
    args, reference, prompts = decode_setup(parser)
    eager, compiled = (exact_assembly(args.model, max_num_seqs=1, compile_decode=c).engine for c in (False, True))
    started = time.perf_counter()
    run_engine(compiled, prompts[:2], args.new_tokens)  # the decode graph compiled
    compile_s = time.perf_counter() - started
    sides = {
        "generate": lambda: bench_generate(reference, prompts, args.new_tokens, 1),
        "engine": lambda: run_engine(eager, prompts, args.new_tokens),
        "engine_compiled": lambda: run_engine(compiled, prompts, args.new_tokens),
    }
    runs: dict[str, list[float]] = {side: [] for side in sides}
    tokens: dict[str, list[list[int]]] = {}
    names = list(sides)
    for repeat in range(args.repeats):  # the order rotates: a run right after another side's is not always one side's
        for side in names[repeat % len(names) :] + names[: repeat % len(names)]:
            rate, tokens[side] = sides[side]()
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

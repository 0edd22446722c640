"""python -m fallbackgate.bench.decode --json bench-engine.json

Decode speed of the engine in exact mode against transformers' own generate() on the same model, prompts,
dtype and batch size, with everything in memory for both: at batch 1 (one prompt at a time) and with every
prompt in one batch (generate() gets them left-padded; the engine batches them continuously). Each
comparison is a ratio at one batch size, with whether both sides produced the same tokens. The variants are
interleaved over the repeats (this machine is noisy); the medians, every run and the ratios are printed and
written as JSON. The comparison with accelerate's disk offload at equal memory is ``fallbackgate.bench.scale``
(both inside one memory cgroup, page cache included).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from fallbackgate.assembly import Assembly
from fallbackgate.bench.engines import exact_assembly
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.tinymoe import CHECKPOINT_DIR

PAD_ID = 0


def _prompts(vocab: int, num: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (length,), generator=gen).tolist() for _ in range(num)]


def bench_generate(
    model: PreTrainedModel, prompts: list[list[int]], new_tokens: int, batch: int
) -> tuple[float, list[list[int]]]:
    """transformers generate(), `batch` prompts per call (left-padded): generated tokens per second, tokens."""
    outputs: list[list[int]] = []
    started = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(prompts), batch):
            group = prompts[first : first + batch]
            width = max(map(len, group))
            ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=PAD_ID,
            )
            outputs.extend(out[:, width:].tolist())
    return sum(map(len, outputs)) / (time.perf_counter() - started), outputs


def engine_assembly(model_dir: str, batch: int) -> Assembly:
    """The engine of this benchmark: exact-only LRU controller, everything in memory, at most `batch` requests
    decoded together."""
    return exact_assembly(model_dir, max_num_seqs=batch)


def run_engine(engine: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """`engine` over `prompts`: generated tokens per second and the tokens."""
    started = time.perf_counter()
    outputs = [out.output_token_ids for out in engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens))]
    return sum(map(len, outputs)) / (time.perf_counter() - started), outputs


def bench_engine(
    model_dir: str, prompts: list[list[int]], new_tokens: int, batch: int
) -> tuple[float, list[list[int]]]:
    """The engine of :func:`engine_assembly`: generated tokens per second and the tokens."""
    return run_engine(engine_assembly(model_dir, batch).engine, prompts, new_tokens)


def decode_setup(parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, PreTrainedModel, list[list[int]]]:
    """The decode benchmarks' shared flags parsed, transformers' reference model and the prompts."""
    parser.add_argument("--model", default=str(CHECKPOINT_DIR))
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts, also the larger batch size")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    reference = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto").eval()
    reference.generation_config.eos_token_id = None  # both sides stop at max_new_tokens only, eos never masked
    return args, reference, _prompts(reference.config.vocab_size, args.num_prompts, args.prompt_len, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="bench-engine.json")
    args, reference, prompts = decode_setup(parser)
    batches = sorted({1, args.num_prompts})
    runs: dict[str, list[float]] = {f"{side}_b{b}": [] for b in batches for side in ("generate", "engine")}
    sides: dict[str, Callable[[int], tuple[float, list[list[int]]]]] = {
        "generate": lambda batch: bench_generate(reference, prompts, args.new_tokens, batch),
        "engine": lambda batch: bench_engine(args.model, prompts, args.new_tokens, batch),
    }
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(args.repeats):  # interleaved so drift on a noisy machine hits every variant alike
        for batch in batches:
            for side, bench in sides.items():
                rate, tokens[f"{side}_b{batch}"] = bench(batch)
                runs[f"{side}_b{batch}"].append(rate)
    medians = {k: statistics.median(v) for k, v in runs.items()}
    result = {
        "model": args.model,
        "dtype": str(reference.dtype).removeprefix("torch."),
        "num_prompts": args.num_prompts,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "batch_sizes": batches,
        "torch_threads": torch.get_num_threads(),
        "tokens_per_s": medians,
        "all_runs": runs,
        "ratios": {f"engine_vs_generate_b{b}": medians[f"engine_b{b}"] / medians[f"generate_b{b}"] for b in batches},
        "tokens_equal": {f"b{b}": tokens[f"engine_b{b}"] == tokens[f"generate_b{b}"] for b in batches},
    }
    print(json.dumps({k: result[k] for k in ("tokens_per_s", "ratios", "tokens_equal")}, indent=2))
    pathlib.Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

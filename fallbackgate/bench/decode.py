"""python -m fallbackgate.bench.decode --json bench-engine.json

Decode speed of the engine in exact mode against transformers' own generate() on the same model and
prompts, and against accelerate's disk offload at a comparable device-memory budget. All numbers come
from one run with the variants interleaved (this machine is noisy); ratios are what to read.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time
import warnings

import torch
from transformers import AutoModelForCausalLM

from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import MIB, EngineConfig
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.tinymoe import CHECKPOINT_DIR


def _prompts(vocab: int, num: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (length,), generator=gen).tolist() for _ in range(num)]


def bench_generate(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> float:
    """transformers generate(), one prompt at a time (batch 1): generated tokens per second."""
    started = time.perf_counter()
    with torch.inference_mode():
        for prompt in prompts:
            model.generate(
                torch.tensor([prompt]),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
    return len(prompts) * new_tokens / (time.perf_counter() - started)


def bench_engine(
    model_dir: str, prompts: list[list[int]], new_tokens: int, budget: int | None, max_num_seqs: int
) -> tuple[float, dict[str, int]]:
    """Engine, exact-only LRU controller: generated tokens per second and the tag counts."""
    engine = Engine(
        EngineConfig(model_dir=model_dir, device_budget_bytes=budget, max_num_seqs=max_num_seqs), ExactLRUController()
    )
    params = SamplingParams(max_new_tokens=new_tokens)
    started = time.perf_counter()
    if max_num_seqs == 1:
        outputs = [engine.generate([p], params)[0] for p in prompts]
    else:
        outputs = engine.generate(prompts, params)
    rate = len(prompts) * new_tokens / (time.perf_counter() - started)
    tags: dict[str, int] = {}
    for out in outputs:
        for tag, count in out.tag_counts.items():
            tags[tag] = tags.get(tag, 0) + count
    return rate, tags


def load_disk_offloaded(model_dir: str, num_layers_on_device: int, offload_dir: str) -> torch.nn.Module:
    """accelerate's disk offload: the first layers in memory, every later decoder layer read from disk."""
    config = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "lm_head": "cpu", "model.rotary_emb": "cpu"}
    for layer in range(config["num_hidden_layers"]):
        device_map[f"model.layers.{layer}"] = "cpu" if layer < num_layers_on_device else "disk"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, device_map=device_map, offload_folder=offload_dir
        )
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(CHECKPOINT_DIR))
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="bench-engine.json")
    args = parser.parse_args()
    reference = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    config = reference.config
    prompts = _prompts(config.vocab_size, args.num_prompts, args.prompt_len, 0)
    probe = Engine(EngineConfig(model_dir=args.model), ExactLRUController())
    expert_bytes = probe.expert_store.bytes_per_expert * len(probe.expert_store.entries)
    kv_bytes = (
        probe.kv_store.bytes_per_block
        * probe.kv_store.num_layers
        * args.num_prompts
        * (-(-(args.prompt_len + args.new_tokens) // probe.config.block_size))
    )
    budget_40 = int(0.4 * expert_bytes) + kv_bytes
    num_layers = config.num_hidden_layers
    offload_dir = tempfile.mkdtemp(prefix="fallbackgate-accelerate-")
    disk_model = load_disk_offloaded(args.model, max(1, round(0.4 * num_layers)), offload_dir)
    runs: dict[str, list[float]] = {
        k: []
        for k in (
            "generate",
            "engine_b1",
            "engine_batched",
            "engine_40pct_b1",
            "engine_40pct_batched",
            "accelerate_disk_40pct",
        )
    }
    tags_40: dict[str, int] = {}
    for _ in range(args.repeats):  # interleaved so drift on a noisy machine hits every variant alike
        runs["generate"].append(bench_generate(reference, prompts, args.new_tokens))
        runs["engine_b1"].append(bench_engine(args.model, prompts, args.new_tokens, None, 1)[0])
        runs["engine_batched"].append(bench_engine(args.model, prompts, args.new_tokens, None, args.num_prompts)[0])
        runs["engine_40pct_b1"].append(bench_engine(args.model, prompts, args.new_tokens, budget_40, 1)[0])
        rate, tags_40 = bench_engine(args.model, prompts, args.new_tokens, budget_40, args.num_prompts)
        runs["engine_40pct_batched"].append(rate)
        runs["accelerate_disk_40pct"].append(bench_generate(disk_model, prompts[:2], args.new_tokens))
    medians = {k: statistics.median(v) for k, v in runs.items()}
    result = {
        "model": args.model,
        "num_prompts": args.num_prompts,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "tokens_per_s": medians,
        "all_runs": runs,
        "device_budget_40pct_mib": budget_40 / MIB,
        "expert_bytes_mib": expert_bytes / MIB,
        "tags_engine_40pct_batched": tags_40,
        "ratios": {
            "engine_b1_vs_generate": medians["engine_b1"] / medians["generate"],
            "engine_batched_vs_generate": medians["engine_batched"] / medians["generate"],
            "engine_40pct_b1_vs_accelerate_disk": medians["engine_40pct_b1"] / medians["accelerate_disk_40pct"],
            "engine_40pct_batched_vs_accelerate_disk": medians["engine_40pct_batched"]
            / medians["accelerate_disk_40pct"],
        },
    }
    print(json.dumps({"tokens_per_s": medians, "ratios": result["ratios"]}, indent=2))
    pathlib.Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

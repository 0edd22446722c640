"""python -m fallbackgate.bench.gpu_check --model DIR --json FILE [--device cuda] [--expert-fraction 0.25]

GPU readiness on a small real-shaped checkpoint (``.ci/gpu-check`` builds one and runs this), four checks:

1. exactness, under identical batch shapes only: the engine at a tight device budget serving one request at
   a time gives transformers' own greedy tokens with the kernel the engine runs (same dtype, ``grouped_mm``
   experts, one prompt at a time). Batched, the matmul shapes differ and bf16 sums round differently, so
   tokens are not compared; its logits must stay within the measured bf16 floor (``--floor-factor`` × the
   largest logit difference between transformers' two correct kernels, eager and ``grouped_mm``, on the
   same prompts), compared up to and including the first step where tokens part;
2. memory: ``torch.cuda.max_memory_allocated()`` stays under dense bytes + device budget + ``--slack-mb``
   (activations, attention workspace and the allocator's rounding, which the budget does not count);
3. pinned host copies: every expert copy the host cache holds at the end is page-locked (so exact loads and
   prefetches are asynchronous copies on the copy stream), and the bytes locked are within what the host
   pool counts for them;
4. speed (reported, not checked): tokens/s of the engine against accelerate's offload given the same GPU
   memory (``device_map="auto"`` with ``max_memory``), measured in this one run.

Imports only the engine (and transformers/accelerate for the references). Writes one JSON object; exit 1
when a check fails, 2 on bad input. ``--device cpu`` runs the same code without the memory check (a dry
run on a machine without a GPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import sys
import time
import warnings
from typing import Any

import torch
from accelerate import init_empty_weights
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from fallbackgate.assembly import Assembly, Overrides
from fallbackgate.batch.prompts import BUILTIN_PROMPTS
from fallbackgate.bench.engines import exact_assembly
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.engine.tags import Tag

MIB = 1 << 20


def _prompts(model: str, num: int) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    return [tokenizer.encode(text) for text in BUILTIN_PROMPTS[:num]]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reference(
    model_dir: str, prompts: list[list[int]], new_tokens: int, device: torch.device, experts: str = "eager"
) -> dict[str, Any]:
    """transformers' greedy decoding with its `experts` kernel, one prompt at a time: tokens and per-step
    logits."""
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, experts_implementation=experts, use_kernels=False
    )
    model = model.to(device).eval()
    tokens, logits = [], []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt], device=device),
                max_new_tokens=new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
                eos_token_id=None,
            )
            tokens.append(out.sequences[0, len(prompt) :].tolist())
            logits.append(torch.stack(out.logits)[:, 0].float().cpu())
    del model
    return {"tokens": tokens, "logits": logits}


def probe_assembly(model: str) -> Assembly:
    """An engine on the CPU that holds no expert anywhere but the checkpoint: its sizes, read before the run."""
    return exact_assembly(model, Overrides(host_budget_bytes=0, device="cpu", is_stacked_when_fits=False))


def budget_assembly(model: str, budget: int, device: str, num_seqs: int) -> Assembly:
    """The measured engine: `budget` device bytes on `device`, at most `num_seqs` requests together."""
    return exact_assembly(model, Overrides(device_budget_bytes=budget, device=device), max_num_seqs=num_seqs)


def max_dlogit_until_tokens_part(
    tokens: list[list[int]], logits: list[torch.Tensor], ref_tokens: list[list[int]], ref_logits: list[torch.Tensor]
) -> float:
    """The largest |logit difference| per request over the steps up to and including the first where the
    tokens differ (later steps see different prefixes)."""
    worst = 0.0
    for mine, mine_logits, theirs, their_logits in zip(tokens, logits, ref_tokens, ref_logits, strict=True):
        parted = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), len(mine) - 1)
        rows = slice(0, parted + 1)
        worst = max(worst, (mine_logits[rows].float() - their_logits[rows].float()).abs().max().item())
    return worst


def run_engine(
    args: argparse.Namespace, prompts: list[list[int]], device: torch.device, num_seqs: int
) -> dict[str, Any]:
    """The engine at a tight budget (`--expert-fraction` of the experts plus every request's KV), at most
    `num_seqs` requests in a batch."""
    probe = probe_assembly(args.model).engine  # sizes only: it reads no expert
    num_experts = len(probe.expert_store.entries)
    kv_bytes = sum(-(-(len(p) + args.new_tokens) // 16) for p in prompts) * probe.kv_store.num_layers
    budget = int(args.expert_fraction * num_experts) * probe.expert_store.bytes_per_expert
    budget += 2 * kv_bytes * probe.kv_store.bytes_per_block
    del probe
    gc.collect()  # an earlier engine of this process (held in reference cycles) is not this one's memory
    baseline = 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    engine = budget_assembly(args.model, budget, device.type, num_seqs).engine
    try:
        _synchronize(device)
        started = time.perf_counter()
        outputs = engine.generate(prompts, SamplingParams(max_new_tokens=args.new_tokens))
        _synchronize(device)
        wall = time.perf_counter() - started
        peak = torch.cuda.max_memory_allocated(device) - baseline if device.type == "cuda" else None
        dense_bytes, peak_pool = engine.num_dense_bytes, engine.kv_store.device_pool.peak_used_bytes
        pinning = host_pinning(engine)
    finally:
        engine.close()  # unlocks its host copies: the next engine may get the same addresses
    del engine
    gc.collect()
    return {
        "tokens": [o.output_token_ids for o in outputs],
        "logits": [o.output_logits.float() for o in outputs],
        "tokens_per_s": sum(len(o.output_token_ids) for o in outputs) / wall,
        "device_budget_bytes": budget,
        "dense_bytes": dense_bytes,
        "peak_device_pool_bytes": peak_pool,
        "max_memory_allocated": peak,  # less what the process held before the engine was built
        "allocated_before_bytes": baseline,
        "tags": {t: sum(o.tag_counts.get(t, 0) for o in outputs) for t in (Tag.RESIDENT.value, Tag.EXACT_LOAD.value)},
        **pinning,
    }


def host_pinning(engine: Any) -> dict[str, int]:
    """The host cache's expert copies at the end of a run: how many, how many the engine locked, how many
    CUDA itself reports pinned (its pointer query, not the engine's records), the bytes locked and the
    bytes the host pool counts for the copies (their footprint each)."""
    host_cache, store = engine.expert_store.host_cache, engine.expert_store
    held = [e.host for e in store.entries.values() if e.host is not None]
    pinner = host_cache.pinner
    is_cuda = store.device.type == "cuda"
    return {
        "host_copies": len(held),
        "host_copies_locked": sum(pinner.is_pinned(h) for h in held) if pinner is not None else 0,
        "host_copies_cuda_pinned": sum(h.gate_up.is_pinned() and h.down.is_pinned() for h in held) if is_cuda else 0,
        "host_locked_bytes": pinner.num_locked_bytes if pinner is not None else 0,
        "host_copies_counted_bytes": len(held) * host_cache.bytes_per_expert,
        "host_copies_left_pageable": host_cache.num_unpinned,
    }


def offload_device_map(model_dir: str, gpu_bytes: int, device: torch.device) -> dict[str, Any]:
    """accelerate's placement at `gpu_bytes` of GPU memory: the embeddings, final norm and head on the GPU,
    then whole decoder layers in order while they fit, the rest offloaded to CPU memory (accelerate moves
    a module, never part of one: a layer's experts stay together). With the embeddings on the GPU the
    offloaded layers execute there, their weights streamed in per forward (``device_map="auto"`` would
    put everything on the CPU and run it there when not even one layer fits)."""
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    gpu: Any = device.index or 0
    device_map: dict[str, Any] = {}
    left = gpu_bytes
    layers = [(f"model.layers.{i}", layer) for i, layer in enumerate(model.model.layers)]
    others = [(f"model.{n}", m) for n, m in model.model.named_children() if n != "layers"]
    for name, module in [*others, ("lm_head", model.lm_head)]:
        device_map[name] = gpu
        left -= sum(p.numel() * p.element_size() for p in module.parameters())
    for name, module in layers:
        size = sum(p.numel() * p.element_size() for p in module.parameters())
        device_map[name] = gpu if size <= left else "cpu"
        left -= size if size <= left else 0
    return device_map


def run_accelerate(
    args: argparse.Namespace, prompts: list[list[int]], budget: int, device: torch.device
) -> tuple[float, int]:
    """accelerate's offload with the engine's GPU memory (dense + device budget): tokens/s, batched, and how
    many decoder layers its placement kept on the GPU."""
    gpu_bytes = budget + args.dense_bytes
    device_map: Any = offload_device_map(args.model, gpu_bytes, device) if device.type == "cuda" else "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(
            args.model, dtype=torch.bfloat16, device_map=device_map, use_kernels=False
        ).eval()
    placed = device_map.items() if isinstance(device_map, dict) else ()
    num_layers_on_gpu = sum(1 for name, where in placed if name.startswith("model.layers.") and where != "cpu")
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    _synchronize(device)
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=args.new_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    _synchronize(device)
    return (out.shape[1] - width) * len(prompts) / (time.perf_counter() - started), num_layers_on_gpu


def check(args: argparse.Namespace) -> dict[str, Any]:
    """All three checks; `passed` is their conjunction."""
    device = torch.device(args.device)
    prompts = _prompts(args.model, args.num_prompts)
    ref = reference(args.model, prompts, args.new_tokens, device)
    grouped = reference(args.model, prompts, args.new_tokens, device, "grouped_mm")
    floor = max_dlogit_until_tokens_part(grouped["tokens"], grouped["logits"], ref["tokens"], ref["logits"])
    single = run_engine(args, prompts, device, num_seqs=1)
    batched = run_engine(args, prompts, device, num_seqs=len(prompts))
    batched_dlogit = max_dlogit_until_tokens_part(
        batched["tokens"], batched["logits"], grouped["tokens"], grouped["logits"]
    )
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "tokens_equal_one_at_a_time": single["tokens"] == grouped["tokens"],
        "max_abs_dlogit_one_at_a_time": max_dlogit_until_tokens_part(
            single["tokens"], single["logits"], grouped["tokens"], grouped["logits"]
        ),
        "tokens_equal_eager_informational": single["tokens"] == ref["tokens"],
        "bf16_floor_eager_vs_grouped_mm": floor,
        "max_abs_dlogit_batched": batched_dlogit,
        "batched_logit_limit": args.floor_factor * floor,
        "tokens_equal_batched_informational": batched["tokens"] == grouped["tokens"],
        **{k: v for k, v in batched.items() if k not in ("tokens", "logits")},
        "slack_bytes": args.slack_mb * MIB,
    }
    result["batched_within_floor"] = batched_dlogit <= result["batched_logit_limit"]
    peak = batched["max_memory_allocated"]
    limit = batched["dense_bytes"] + batched["device_budget_bytes"] + args.slack_mb * MIB
    result["memory_within_limit"] = peak is None or peak <= limit
    args.dense_bytes = batched["dense_bytes"]
    accelerate_rate, num_layers_on_gpu = run_accelerate(args, prompts, batched["device_budget_bytes"], device)
    result["accelerate_tokens_per_s"] = accelerate_rate
    result["engine_over_accelerate"] = batched["tokens_per_s"] / accelerate_rate
    result["accelerate_layers_on_gpu"] = num_layers_on_gpu
    result["host_copies_pinned"] = device.type != "cuda" or (
        batched["host_copies"] > 0
        and batched["host_copies_locked"] == batched["host_copies_cuda_pinned"] == batched["host_copies"]
        and batched["host_locked_bytes"] <= batched["host_copies_counted_bytes"]
    )
    checks = ("tokens_equal_one_at_a_time", "batched_within_floor", "memory_within_limit", "host_copies_pinned")
    result["passed"] = all(result[name] for name in checks)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fallbackgate.bench.gpu_check", description=__doc__.splitlines()[2])
    p.add_argument("--model", required=True, help="checkpoint directory (e.g. a 2-layer synth OLMoE)")
    p.add_argument("--json", required=True, help="where to write the result")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu for a dry run")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--expert-fraction", type=float, default=0.25, help="share of experts the budget holds")
    p.add_argument("--slack-mb", type=int, default=512, help="GPU memory allowed beyond dense + budget")
    p.add_argument(
        "--floor-factor", type=float, default=2.0, help="batched logits may differ by this × the measured bf16 floor"
    )
    args = p.parse_args(argv)
    if not (pathlib.Path(args.model) / "config.json").is_file():
        print(f"error: --model {args.model}: no config.json", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    result = check(args)
    pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    for key, value in result.items():
        print(f"{key:28s} {value}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

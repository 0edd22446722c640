"""python -m fallbackgate.bench.scale_child {engine|accelerate|generate} --model DIR --out FILE --workload KIND ...

One measured variant of ``fallbackgate.bench.scale``, run in its own process (inside a memory cgroup when
the parent says so). Each writes one JSON object to ``--out``; times are wall clock of generation only
(loading excluded, reported separately). The prompts are ``fallbackgate workload KIND``'s requests from
``--seed`` (answers capped at ``--max-new-tokens``), all submitted at once (arrival times not honoured).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import tempfile
import time
import warnings
from typing import Any, cast

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fallbackgate.assembly import Assembly, Overrides
from fallbackgate.bench.engines import exact_assembly
from fallbackgate.engine.config import MIB
from fallbackgate.engine.experts.sources import map_experts
from fallbackgate.engine.model.checkpoint_files import CheckpointFiles
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.engine.tags import Tier
from fallbackgate.sweep.belady import TraceRecorder
from fallbackgate.sweep.measures import proc_io
from fallbackgate.workloads.build import generate
from fallbackgate.workloads.kinds import Context, WorkloadKind
from fallbackgate.workloads.text import TextPool
from fallbackgate.workloads.tokens import ModelTokens, length_limit

Prompt = tuple[list[int], int]  # (token ids, new tokens)


def workload_prompts(model: str, kind: str, seed: int, num_prompts: int, max_new_tokens: int) -> list[Prompt]:
    """`num_prompts` requests of workload `kind` from `seed` as (token ids, new tokens capped at `max_new_tokens`)."""
    tokens = ModelTokens(model)
    ctx = Context(tokens, TextPool.load(tokens, None), length_limit(model, None).tokens)
    requests = generate(ctx, WorkloadKind(kind), seed, num_prompts, None).requests
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    return [(tokenizer.encode(r.prompt), min(max_new_tokens, r.max_new_tokens)) for r in requests]


def kernel_read_bytes() -> int:
    """This process's bytes read from storage so far, as the kernel counts them (``/proc/self/io``)."""
    return proc_io()["read_bytes"]


def drop_page_cache(model: str) -> None:
    """Forget the checkpoint's cached pages so the next reads come from disk."""
    for path in pathlib.Path(model).glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def engine_assembly(args: argparse.Namespace) -> Assembly:
    """The engine the flags describe: exact-only, the expert-access trace recorded, all prompts batched together;
    under one RAM budget of ``--ram-budget-mb`` (on a CPU the device budget is the RAM budget), else everything
    fits."""
    budget = {} if args.ram_budget_mb is None else {"device_budget_bytes": int(args.ram_budget_mb * MIB)}
    overrides = Overrides(
        is_stacked_when_fits=not args.no_stack,
        num_io_threads=args.io_threads,
        wrap_controller=TraceRecorder,
        **budget,
    )
    return exact_assembly(args.model, overrides, max_num_seqs=args.num_prompts)


def run_engine(args: argparse.Namespace) -> dict[str, Any]:
    """The engine on the workload's prompts, continuously batched, exact-only, trace and bytes by tag recorded."""
    started = time.perf_counter()
    built = engine_assembly(args)
    engine = built.engine
    recorder = cast(TraceRecorder, built.controller)  # wrap_controller=TraceRecorder
    loaded_s = time.perf_counter() - started
    prompts = workload_prompts(args.model, args.workload, args.seed, args.num_prompts, args.max_new_tokens)
    store = engine.expert_store
    reads_before, kernel_before = store.num_disk_reads, kernel_read_bytes()
    started = time.perf_counter()
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=n)) for p, n in prompts]
    tagged: dict[str, int] = {}
    while engine.has_unfinished():
        for event in engine.step().events:
            if event.source_tier is Tier.DISK:
                tagged[event.tag.value] = tagged.get(event.tag.value, 0) + event.bytes_moved
    wall = time.perf_counter() - started
    kernel_read = kernel_read_bytes() - kernel_before
    outputs = [engine.finished.pop(i) for i in ids if i in engine.finished]
    source = next(iter(map_experts(CheckpointFiles(pathlib.Path(args.model))).values()))
    return {
        "load_s": loaded_s,
        "wall_s": wall,
        "num_requests": len(prompts),
        "num_prompt_tokens": sum(len(p) for p, _ in prompts),
        "num_output_tokens": sum(len(o.output_token_ids) for o in outputs),
        "output_token_ids": [o.output_token_ids for o in outputs],
        "num_failed": len(prompts) - len(outputs),
        "disk_bytes_by_tag": tagged,
        "kernel_read_bytes": kernel_read,
        "num_expert_disk_reads": store.num_disk_reads - reads_before,
        "bytes_per_expert": store.bytes_per_expert,
        "checkpoint_bytes_per_expert": store.checkpoint_bytes_per_expert,
        "expert_io_bytes": store.checkpoint_bytes_per_expert // len(source.parts),  # one read per tensor
        "ram_budget_bytes": store.device_pool.budget_bytes,
        "num_expert_slots": store.device_pool.budget_bytes // store.bytes_per_expert,
        "peak_ram_pool_bytes": store.device_pool.peak_used_bytes,
        "dense_bytes": engine.num_dense_bytes,
        "trace": [list(k) for k in recorder.trace],
    }


def _accelerate_model(args: argparse.Namespace, offload_dir: str) -> torch.nn.Module:
    config = json.loads((pathlib.Path(args.model) / "config.json").read_text())
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "lm_head": "cpu", "model.rotary_emb": "cpu"}
    for layer in range(config["num_hidden_layers"]):
        device_map[f"model.layers.{layer}"] = "cpu" if layer < args.layers_in_memory else "disk"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(
            args.model, dtype=torch.bfloat16, device_map=device_map, offload_folder=offload_dir
        )
    return model.eval()


def run_transformers(args: argparse.Namespace, is_offloaded: bool) -> dict[str, Any]:
    """transformers' generate() on the same prompts (left-padded batch), in memory or disk-offloaded."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.scratch) as offload_dir:
        if is_offloaded:
            model = _accelerate_model(args, offload_dir)
        else:
            model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).eval()
        loaded_s = time.perf_counter() - started
        pairs = workload_prompts(args.model, args.workload, args.seed, args.num_prompts, args.max_new_tokens)
        prompts, max_new = [p for p, _ in pairs], max(n for _, n in pairs)  # every row runs to the longest answer
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        model.generation_config.eos_token_id = None
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, pad_token_id=0)
        wall = time.perf_counter() - started
    tokens = out[:, width:].tolist()
    return {"load_s": loaded_s, "wall_s": wall, "num_output_tokens": sum(map(len, tokens)), "output_token_ids": tokens}


def peak_rss_bytes() -> int:
    """The most resident memory this process ever had (anonymous and file-backed pages it mapped)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m fallbackgate.bench.scale_child")
    p.add_argument("variant", choices=("engine", "accelerate", "generate"))
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--workload", default=WorkloadKind.SHORT_CHAT.value, choices=[k.value for k in WorkloadKind])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ram-budget-mb", type=float, default=None, help="the engine's one RAM budget (None: all fits)")
    p.add_argument("--layers-in-memory", type=int, default=0)
    p.add_argument("--scratch", default=None, help="directory for accelerate's offload folder")
    p.add_argument("--no-stack", action="store_true", help="everything in memory, but experts kept one by one")
    p.add_argument("--io-threads", type=int, default=None, help="engine threads reading experts ahead (0: none)")
    args = p.parse_args()
    torch.manual_seed(0)
    runners = {
        "engine": lambda: run_engine(args),
        "accelerate": lambda: run_transformers(args, is_offloaded=True),
        "generate": lambda: run_transformers(args, is_offloaded=False),
    }
    result = runners[args.variant]()
    result["peak_rss_bytes"] = peak_rss_bytes()
    pathlib.Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()

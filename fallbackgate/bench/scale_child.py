"""python -m fallbackgate.bench.scale_child {engine|accelerate|generate|diskread} --model DIR --out FILE ...

One measured variant of ``fallbackgate.bench.scale``, run in its own process (inside a memory cgroup when
the parent says so). Each writes one JSON object to ``--out``; times are wall clock of generation only
(loading excluded, reported separately).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import resource
import tempfile
import time
import warnings
from typing import Any, cast

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fallbackgate.assembly import Assembly, Overrides, fold_host_into_ram
from fallbackgate.batch.prompts import BUILTIN_PROMPTS
from fallbackgate.bench.engines import exact_assembly
from fallbackgate.engine.config import MIB
from fallbackgate.engine.experts.reader import map_experts, read_source
from fallbackgate.engine.model.checkpoint_files import CheckpointFiles
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.sweep.belady import TraceRecorder


def prompt_ids(model: str, num_prompts: int) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    return [tokenizer.encode(text) for text in BUILTIN_PROMPTS[:num_prompts]]


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
    budgets in MiB when ``--device-budget-mb`` is given (then ``--host-budget-mb`` too), else everything fits."""
    budgets: dict[str, int] = {}
    if args.device_budget_mb is not None:  # on a CPU one RAM budget of both (no host tier)
        device, host = fold_host_into_ram(args.device_budget_mb * MIB, args.host_budget_mb * MIB)
        budgets = {"device_budget_bytes": int(device or 0)} | ({} if host is None else {"host_budget_bytes": int(host)})
    overrides = Overrides(
        is_stacked_when_fits=not args.no_stack,
        num_io_threads=args.io_threads,
        wrap_controller=TraceRecorder,
        **budgets,
    )
    return exact_assembly(args.model, overrides, max_num_seqs=args.num_prompts)


def run_engine(args: argparse.Namespace) -> dict[str, Any]:
    """The engine with the given budgets, all prompts continuously batched, exact-only, trace recorded."""
    started = time.perf_counter()
    built = engine_assembly(args)
    engine = built.engine
    recorder = cast(TraceRecorder, built.controller)  # wrap_controller=TraceRecorder
    loaded_s = time.perf_counter() - started
    prompts = prompt_ids(args.model, args.num_prompts)
    reads_before = engine.expert_store.num_disk_reads
    started = time.perf_counter()
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=args.max_new_tokens))
    wall = time.perf_counter() - started
    tags: dict[str, int] = {}
    for out in outputs:
        for tag, count in out.tag_counts.items():
            tags[tag] = tags.get(tag, 0) + count
    store = engine.expert_store
    return {
        "load_s": loaded_s,
        "wall_s": wall,
        "num_output_tokens": sum(len(o.output_token_ids) for o in outputs),
        "output_token_ids": [o.output_token_ids for o in outputs],
        "tags": tags,
        "num_expert_disk_reads": store.num_disk_reads - reads_before,
        "bytes_per_expert": store.bytes_per_expert,
        "num_expert_slots": (store.device_pool.budget_bytes + store.host_pool.budget_bytes) // store.bytes_per_expert,
        "peak_device_pool_bytes": store.device_pool.peak_used_bytes,
        "peak_host_pool_bytes": store.host_pool.peak_used_bytes,
        "dense_bytes": engine.num_dense_bytes,
        "trace": [list(k) for k in recorder.trace],
        "expert_reads": store.read_ahead.total.summary(),
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
        prompts = prompt_ids(args.model, args.num_prompts)
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        model.generation_config.eos_token_id = None
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=0
            )
        wall = time.perf_counter() - started
    tokens = out[:, width:].tolist()
    return {"load_s": loaded_s, "wall_s": wall, "num_output_tokens": sum(map(len, tokens)), "output_token_ids": tokens}


def run_diskread(args: argparse.Namespace) -> dict[str, Any]:
    """Cold reads of random whole experts with the engine's read pattern (mmap slices, one expert at a time)."""
    files = CheckpointFiles(pathlib.Path(args.model))
    sources = map_experts(files)
    keys = random.Random(0).sample(sorted(sources), min(args.num_reads, len(sources)))
    drop_page_cache(args.model)
    num_bytes, started = 0, time.perf_counter()
    for key in keys:
        weights = read_source(files, sources[key])
        num_bytes += weights.num_bytes
    wall = time.perf_counter() - started
    return {"num_experts": len(keys), "bytes": num_bytes, "wall_s": wall, "bytes_per_s": num_bytes / wall}


def peak_rss_bytes() -> int:
    """The most resident memory this process ever had (anonymous and file-backed pages it mapped)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m fallbackgate.bench.scale_child")
    p.add_argument("variant", choices=("engine", "accelerate", "generate", "diskread"))
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--device-budget-mb", type=float, default=None)
    p.add_argument("--host-budget-mb", type=float, default=None)
    p.add_argument("--layers-in-memory", type=int, default=0)
    p.add_argument("--num-reads", type=int, default=64)
    p.add_argument("--scratch", default=None, help="directory for accelerate's offload folder")
    p.add_argument("--no-stack", action="store_true", help="everything in memory, but experts kept one by one")
    p.add_argument("--io-threads", type=int, default=None, help="engine threads reading experts ahead (0: none)")
    args = p.parse_args()
    torch.manual_seed(0)
    runners = {
        "engine": lambda: run_engine(args),
        "accelerate": lambda: run_transformers(args, is_offloaded=True),
        "generate": lambda: run_transformers(args, is_offloaded=False),
        "diskread": lambda: run_diskread(args),
    }
    result = runners[args.variant]()
    result["peak_rss_bytes"] = peak_rss_bytes()
    pathlib.Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()

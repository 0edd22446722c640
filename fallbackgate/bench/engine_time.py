"""python -m fallbackgate.bench.engine_time --model DIR [--budget-model DIR] --json bench-engine-time.json

Engine time on a real-shaped checkpoint (e.g. ``python -m fallbackgate.synth --like olmoe-1b-7b --num-layers 2``),
everything measured in one run on this machine, variants interleaved, ratios printed:

- scaling: decode step time for batch 1/4/16 × context 256/1024/4064, with a least-squares fit over batch and the
  total KV tokens (attention per request: the cost grows linearly in total KV, not in batch²);
- continuous batching: the engine against transformers' own ``generate_batch`` (``paged|sdpa``), everything
  in memory, 8 prompts;
- batch 1: the engine against ``generate()``, and the fraction of the weight-streaming floor it reaches (the
  bytes a decode token must read ÷ the measured profile's weight streaming rate);
- read-ahead at a 40 % expert budget (``--budget-model``, 30 % more in host memory, the rest on disk):
  tokens/s with expert reads on I/O threads against reads on the compute thread, the share of read time
  hidden under compute and the next-layer prediction's precision and recall.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import sys
import time
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from fallbackgate.assembly import Assembly, Overrides, fold_host_into_ram
from fallbackgate.bench.engines import exact_assembly
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.messages import StepKind
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.profiling.store import measured_profile

BATCHES, CONTEXTS = (1, 4, 16), (256, 1024, 4064)


def _prompts(vocab: int, num: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(num)]


def engine_assembly(model: str, num_seqs: int, max_len: int, **knobs: Any) -> Assembly:
    """The exact-mode engine with at most `num_seqs` requests of `max_len` tokens; `knobs` are further
    :class:`Overrides` fields (tokens per forward, read-ahead threads, budgets in bytes)."""
    return exact_assembly(model, Overrides(max_model_len=max_len, **knobs), max_num_seqs=num_seqs)


def _engine(model: str, num_seqs: int, max_len: int, **knobs: Any) -> Engine:
    return engine_assembly(model, num_seqs, max_len, **knobs).engine


def decode_step_s(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Median wall time of the steps in which every request decodes one token."""
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_new_tokens=new_tokens), request_id=f"p{len(engine.sequences)}")
    times = []
    while engine.has_unfinished():
        result = engine.step()
        if result.kind is StepKind.DECODE and len(result.request_ids) == len(prompts):
            times.append(result.wall_s)
    return statistics.median(times)


def scaling(model: str, vocab: int) -> dict[str, Any]:
    points = []
    for context in CONTEXTS:
        for batch in BATCHES:  # one prefill step for the whole batch, then every request decodes together
            engine = _engine(model, batch, context + 16, max_num_batched_tokens=batch * (context + 1))
            step_s = decode_step_s(engine, _prompts(vocab, batch, context, seed=batch), 6)
            points.append({"batch": batch, "context": context, "kv_tokens": batch * context, "step_s": step_s})
            print(f"  batch {batch:2d} context {context:4d}: decode step {step_s * 1e3:8.1f} ms", flush=True)
    return {"points": points, **fit_step_time(points)}


def fit_step_time(points: list[dict[str, Any]]) -> dict[str, float]:
    """Least squares ``step_s = fixed + per_request · batch + per_kv_token · kv_tokens``, with R²."""
    design = torch.tensor([[1.0, p["batch"], p["kv_tokens"]] for p in points], dtype=torch.float64)
    target = torch.tensor([[p["step_s"]] for p in points], dtype=torch.float64)
    coef = torch.linalg.lstsq(design, target).solution[:, 0]
    fitted = (design @ coef).tolist()
    ys = target[:, 0].tolist()
    mean = statistics.fmean(ys)
    r2 = 1 - sum((y - f) ** 2 for y, f in zip(ys, fitted, strict=True)) / sum((y - mean) ** 2 for y in ys)
    return {"fixed_s": coef[0].item(), "s_per_request": coef[1].item(), "s_per_kv_token": coef[2].item(), "r2": r2}


def _timed_engine(model: str, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    engine = _engine(model, len(prompts), 1024)
    started = time.perf_counter()
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens))
    return len(prompts) * new_tokens / (time.perf_counter() - started), [o.output_token_ids for o in outputs]


def _hf_model(model: str, attention: str = "sdpa") -> torch.nn.Module:
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16, attn_implementation=attention).eval()
    hf.generation_config.eos_token_id = None
    return hf


def continuous_batching(model: str, vocab: int, rounds: int = 2) -> dict[str, Any]:
    prompts, new = _prompts(vocab, 8, 128, seed=7), 32
    hf = _hf_model(model, "paged|sdpa")
    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    engine_rates, hf_rates = [], []
    for _ in range(rounds):  # interleaved
        rate, _ = _timed_engine(model, prompts, new)
        engine_rates.append(rate)
        started = time.perf_counter()
        with torch.inference_mode():
            hf.generate_batch(prompts, generation_config=config, warmup=False)
        hf_rates.append(len(prompts) * new / (time.perf_counter() - started))
    ratio = max(engine_rates) / max(hf_rates)
    print(
        f"  continuous batching: engine {max(engine_rates):.2f} tok/s, "
        f"generate_batch {max(hf_rates):.2f} ({ratio:.2f}×)"
    )
    return {"engine_tokens_per_s": engine_rates, "generate_batch_tokens_per_s": hf_rates, "ratio": ratio}


def batch_one(model: str, vocab: int, rounds: int = 2) -> dict[str, Any]:
    prompt, new = _prompts(vocab, 1, 128, seed=3), 32
    hf = _hf_model(model)
    engine_rates, hf_rates = [], []
    for _ in range(rounds):
        rate, _ = _timed_engine(model, prompt, new)
        engine_rates.append(rate)
        started = time.perf_counter()
        with torch.inference_mode():
            hf.generate(torch.tensor(prompt), max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        hf_rates.append(new / (time.perf_counter() - started))
    probe = _engine(model, 1, 256)
    top_k = int(getattr(probe.model_config, "num_experts_per_tok", 1))
    layers = len(probe.loaded_experts)
    token_bytes = probe.num_dense_bytes + layers * top_k * probe.expert_store.bytes_per_expert
    floor = measured_profile(quiet=True).device_bytes_per_s / token_bytes
    best = max(engine_rates)
    print(f"  batch 1: engine {best:.2f} tok/s, generate() {max(hf_rates):.2f}, floor {floor:.2f} ({best / floor:.2f})")
    return {
        "engine_tokens_per_s": engine_rates,
        "generate_tokens_per_s": hf_rates,
        "ratio": best / max(hf_rates),
        "bytes_per_decode_token": token_bytes,
        "weight_streaming_floor_tokens_per_s": floor,
        "fraction_of_floor": best / floor,
    }


def read_ahead(model: str, vocab: int) -> dict[str, Any]:
    probe = _engine(model, 4, 512)
    total = len(probe.expert_store.entries) * probe.expert_store.bytes_per_expert
    device, host = fold_host_into_ram(0.4 * total, 0.3 * total)  # on a CPU one RAM budget (no host tier)
    budgets = {"device_budget_bytes": int(device or 0)} | ({} if host is None else {"host_budget_bytes": int(host)})
    prompts, new, out = _prompts(vocab, 4, 64, seed=11), 12, {}
    for threads in (2, 0, 2, 0):  # interleaved; the second of each kept
        engine = _engine(model, 4, 512, num_io_threads=threads, **budgets)
        started = time.perf_counter()
        outputs = engine.generate(prompts, SamplingParams(max_new_tokens=new))
        wall = time.perf_counter() - started
        out[f"io_threads_{threads}"] = {
            "tokens_per_s": len(prompts) * new / wall,
            **engine.expert_store.read_ahead.total.summary(),
            "output_token_ids": [o.output_token_ids for o in outputs],
        }
        engine.close()
    on, off = out["io_threads_2"], out["io_threads_0"]
    out["speedup"] = on["tokens_per_s"] / off["tokens_per_s"]
    out["tokens_equal"] = on["output_token_ids"] == off["output_token_ids"]
    print(
        f"  40 % budget: read-ahead {on['tokens_per_s']:.2f} tok/s vs {off['tokens_per_s']:.2f} "
        f"({out['speedup']:.2f}×), "
        f"hidden {on['hidden_fraction']:.0%}, precision {on['prefetch_precision']}, recall {on['prefetch_recall']:.2f}"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fallbackgate.bench.engine_time", description=__doc__)
    p.add_argument("--model", required=True, help="real-shaped checkpoint that fits in memory")
    p.add_argument("--budget-model", default=None, help="checkpoint for the 40 %% budget part (default --model)")
    p.add_argument("--json", default="bench-engine-time.json")
    args = p.parse_args(argv)
    if not (pathlib.Path(args.model) / "config.json").is_file():
        print(f"error: --model {args.model}: no config.json", file=sys.stderr)
        return 2
    vocab = int(json.loads((pathlib.Path(args.model) / "config.json").read_text())["vocab_size"])
    result: dict[str, Any] = {"model": args.model}
    print("scaling (decode step vs total KV):", flush=True)
    result["scaling"] = scaling(args.model, vocab)
    fit = result["scaling"]
    print(
        f"  step = {fit['fixed_s'] * 1e3:.1f} ms + {fit['s_per_request'] * 1e3:.2f} ms/request + "
        f"{fit['s_per_kv_token'] * 1e9:.0f} ns/KV token (R² {fit['r2']:.3f})"
    )
    result["continuous_batching"] = continuous_batching(args.model, vocab)
    result["batch_one"] = batch_one(args.model, vocab)
    result["read_ahead"] = read_ahead(args.budget_model or args.model, vocab)
    pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

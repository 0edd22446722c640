"""python -m fallbackgate.bench.moe_layer --model DIR [--model DIR ...] --json bench-moe-layer.json

MoE-layer wall time of the engine against transformers' own ``grouped_mm`` experts forward on identical
inputs. Make the checkpoints with, e.g.::

    python -m fallbackgate.synth --like qwen3-30b-a3b --num-layers 2 --out ckpt/qwen3
    python -m fallbackgate.synth --like deepseek-v2-lite --num-layers 2 --out ckpt/dsv2lite

For each checkpoint and batch (1, 8, 32), two engines decode the same prompts together: one with
everything resident (each layer's experts stacked) and one under a budget holding `--resident-fraction`
of the experts (the rest are ``exact_load``ed into the slot pool as routed). Every experts call of a decode
step is timed in the engine and its inputs (hidden states, routing) are kept; right after that step,
transformers' ``grouped_mm_experts_forward`` runs on the same inputs with the resident engine's stacked
weights (the module transformers built, holding every expert). Steps of the two engines alternate, so a
loaded machine slows both alike. Under the budget the time spent placing experts (disk reads and the copy
into a slot) is reported separately as I/O wait, and the ratio excludes it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers.integrations.moe import grouped_mm_experts_forward

from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.messages import StepKind
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.engine.tags import ObjectKind, Tag

BATCHES = (1, 8, 32)
PROMPT_TOKENS, NEW_TOKENS = 16, 5


def _synchronize() -> None:
    """Wait for the GPU's queued work (its kernels run asynchronously), so wall clocks time the work itself."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class LayerTimer:
    """Wraps an engine's experts calls: wall time per call, the time spent placing experts, the inputs."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.calls = engine, []
        self.io_s = 0.0
        run, place = engine.executor.run_experts, engine.expert_store.place

        def timed_place(*args: Any, **kwargs: Any) -> Any:
            _synchronize()
            started = time.perf_counter()
            try:
                return place(*args, **kwargs)
            finally:
                _synchronize()
                self.io_s += time.perf_counter() - started

        def timed_run(module, layer, hidden, top_k_index, top_k_weights):  # noqa: ANN001, ANN202
            _synchronize()
            io_before, started = self.io_s, time.perf_counter()
            out = run(module, layer, hidden, top_k_index, top_k_weights)
            _synchronize()
            wall = time.perf_counter() - started
            self.calls.append(
                (layer, hidden.clone(), top_k_index.clone(), top_k_weights.clone(), wall, self.io_s - io_before)
            )
            return out

        engine.executor.run_experts = timed_run
        engine.expert_store.place = timed_place

    def take(self) -> list[tuple]:
        calls, self.calls = self.calls, []
        return calls


def _engine(model: str, num_seqs: int, device_budget_bytes: int | None) -> Engine:
    config = EngineConfig(
        model_dir=model,
        block_size=16,
        max_num_seqs=num_seqs,
        max_num_batched_tokens=num_seqs * PROMPT_TOKENS,
        device_budget_bytes=device_budget_bytes,
    )
    return Engine(config, ExactLRUController())


def _transformers_s(modules: dict[int, torch.nn.Module], calls: list[tuple]) -> list[float]:
    """transformers' grouped experts forward on each captured call's inputs, timed."""
    times = []
    with torch.inference_mode():
        for layer, hidden, index, weights, _, _ in calls:
            _synchronize()
            started = time.perf_counter()
            grouped_mm_experts_forward(modules[layer], hidden, index, weights)
            _synchronize()
            times.append(time.perf_counter() - started)
    return times


def _budget_bytes(engine: Engine, fraction: float, num_seqs: int) -> int:
    store, kv = engine.expert_store, engine.kv_store
    blocks = num_seqs * (-(-(PROMPT_TOKENS + NEW_TOKENS + 1) // kv.block_size)) * kv.num_layers
    return int(fraction * len(store.entries)) * store.bytes_per_expert + 2 * blocks * kv.bytes_per_block


def _run_pair(model: str, batch: int, fraction: float, seed: int) -> dict[str, Any]:
    roomy = _engine(model, batch, None)
    budget = _engine(model, batch, _budget_bytes(roomy, fraction, batch))
    modules = roomy.loaded_experts  # transformers' experts modules, holding their layer's stacked experts
    timers = {"resident": LayerTimer(roomy), "budget": LayerTimer(budget)}
    rng = random.Random(seed)
    vocab = roomy.model_config.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(batch)]
    stats: dict[str, dict[str, list[float]]] = {k: {"engine": [], "io": [], "transformers": []} for k in timers}
    uses = {Tag.EXACT_LOAD: 0, Tag.RESIDENT: 0}  # the budget engine's decode-step expert uses
    for name, engine in (("resident", roomy), ("budget", budget)):
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, SamplingParams(max_new_tokens=NEW_TOKENS), request_id=f"{name}{i}")
    while roomy.has_unfinished() or budget.has_unfinished():
        for name, engine in (("resident", roomy), ("budget", budget)):  # interleaved, step by step
            if not engine.has_unfinished():
                continue
            result = engine.step()
            calls = timers[name].take()
            if result.kind is not StepKind.DECODE or len(result.request_ids) != batch:
                continue
            stats[name]["engine"] += [c[4] for c in calls]
            stats[name]["io"] += [c[5] for c in calls]
            stats[name]["transformers"] += _transformers_s(modules, calls)
            if name == "budget":
                _count_uses(result, uses)
    out: dict[str, Any] = {"batch": batch}
    for name, s in stats.items():  # means over every MoE-layer call of the decode steps
        engine_s, io_s, hf_s = (statistics.fmean(s[k]) for k in ("engine", "io", "transformers"))
        out[name] = {
            "engine_ms": engine_s * 1e3,
            "io_wait_ms": io_s * 1e3,
            "engine_excl_io_ms": (engine_s - io_s) * 1e3,
            "transformers_ms": hf_s * 1e3,
            "ratio": (engine_s - io_s) / hf_s,
            "num_calls": len(s["engine"]),
        }
    out["budget"]["miss_fraction"] = uses[Tag.EXACT_LOAD] / max(1, sum(uses.values()))
    assert roomy.expert_store.stacked_layers and not budget.expert_store.stacked_layers
    return out


def _count_uses(result: Any, uses: dict[Tag, int]) -> None:
    """Add a step's expert uses: (expert, request) uses served resident, and those loaded."""
    uses[Tag.RESIDENT] += sum(sum(by_layer.values()) for by_layer in result.expert_resident_uses.values())
    for event in result.events:
        if event.tag in uses and event.object_kind is ObjectKind.EXPERT:
            uses[event.tag] += event.count


def main(argv: list[str] | None = None, run: Callable[..., dict[str, Any]] = _run_pair) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", required=True, help="checkpoint directory (repeatable)")
    parser.add_argument("--resident-fraction", type=float, default=0.8, help="experts the budget holds")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--json", default="bench-moe-layer.json")
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    results = []
    for model in args.model:
        for batch in (int(b) for b in args.batches.split(",")):
            row = {"model": model, **run(model, batch, args.resident_fraction, seed=batch)}
            results.append(row)
            r, b = row["resident"], row["budget"]
            print(
                f"{model} batch {batch:2d}: resident {r['engine_excl_io_ms']:.2f} ms vs {r['transformers_ms']:.2f} ms "
                f"({r['ratio']:.2f}x); budget {b['engine_excl_io_ms']:.2f} ms + io {b['io_wait_ms']:.2f} ms vs "
                f"{b['transformers_ms']:.2f} ms ({b['ratio']:.2f}x, miss {b['miss_fraction']:.2f})",
                flush=True,
            )
    with open(args.json, "w") as f:
        json.dump({"results": results, "device": "cpu" if not torch.cuda.is_available() else "cuda"}, f, indent=2)


if __name__ == "__main__":
    main()

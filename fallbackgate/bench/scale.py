"""python -m fallbackgate.bench.scale --model DIR --json bench-scale.json [--cgroup-mb 8192] [--host-budget-mb 4096]
                                     [--device-budget-mb 2048] [--num-prompts 4] [--max-new-tokens 8]

A checkpoint larger than memory (e.g. ``python -m fallbackgate.synth --like olmoe-1b-7b --out DIR``, 13.5 GB
in bf16), measured in one run on this machine (root and the cgroup v1 memory controller needed):

(a) the engine inside a memory cgroup capped at ``--cgroup-mb`` (page cache included), streaming experts
    with the engine's default I/O threads, and again with the other choice (reads ahead on 2 I/O threads,
    or every read on the compute thread), for the read-ahead ratio;
(b) accelerate's disk offload inside the same cgroup, given the same memory for weights;
(c) the physical bound: expert-miss bytes per token, counted as Belady's MIN would at the engine's cache
    size on the engine's own expert trace, divided by the cold per-expert random read bandwidth;
(d) the same checkpoint with everything in memory (no cgroup): the engine (each layer's experts stacked,
    transformers' grouped_mm kernels) against transformers' generate(); and the greedy tokens of (a)
    against the in-memory engine with experts kept one by one (the same kernels as (a): bf16 near-ties
    flip between kernels) under identical scheduling.
Every variant runs in its own process; ratios are computed from this one run.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
from typing import Any

from fallbackgate.bench.scale_child import drop_page_cache
from fallbackgate.engine.config import default_io_threads
from fallbackgate.sweep.belady import belady_misses, lru_misses

CGROUP_ROOT = pathlib.Path("/sys/fs/cgroup/memory")
GIB = 1 << 30


class Cgroup:
    """A cgroup v1 memory group: a cap that counts anonymous memory and page cache."""

    def __init__(self, name: str, limit_bytes: int) -> None:
        self.path = CGROUP_ROOT / name
        self.path.mkdir(exist_ok=True)
        (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))

    def reset_peak(self) -> None:
        (self.path / "memory.max_usage_in_bytes").write_text("0")

    def peak_bytes(self) -> int:
        return int((self.path / "memory.max_usage_in_bytes").read_text())

    def remove(self) -> None:
        self.path.rmdir()


def run_child(variant: str, args: argparse.Namespace, extra: list[str], cgroup: Cgroup | None) -> dict[str, Any]:
    """Run one variant in a fresh process (inside `cgroup` when given) and return its JSON plus exit status."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
        out_path = out.name
    cmd = [sys.executable, "-m", "fallbackgate.bench.scale_child", variant, "--model", args.model, "--out", out_path]
    cmd += ["--num-prompts", str(args.num_prompts), "--max-new-tokens", str(args.max_new_tokens), *extra]
    drop_page_cache(args.model)
    if cgroup is not None:
        cgroup.reset_peak()
        script = f'echo $$ > {cgroup.path}/cgroup.procs && exec "$@"'
        cmd = ["bash", "-c", script, "bash", *cmd]
    print(f"[{variant}{' in cgroup' if cgroup else ''}] running ...", flush=True)
    done = subprocess.run(cmd, check=False)
    result = json.loads(pathlib.Path(out_path).read_text()) if done.returncode == 0 else {}
    os.unlink(out_path)
    result["exit_status"] = done.returncode
    if cgroup is not None:
        result["cgroup_peak_bytes"] = cgroup.peak_bytes()
    if done.returncode == 0 and "num_output_tokens" in result:
        result["tokens_per_s"] = result["num_output_tokens"] / result["wall_s"]
    print(f"[{variant}] exit {done.returncode}, {result.get('tokens_per_s', 0):.3f} tokens/s", flush=True)
    return result


def physical_bound(engine: dict[str, Any], read: dict[str, Any]) -> dict[str, Any]:
    """Tokens/s if only Belady-optimal expert misses cost time, at the measured random read bandwidth."""
    trace = [tuple(k) for k in engine["trace"]]
    slots = int(engine["num_expert_slots"])
    misses = belady_misses(trace, slots)
    miss_bytes_per_token = misses * engine["bytes_per_expert"] / engine["num_output_tokens"]
    return {
        "num_expert_slots": slots,
        "num_expert_uses": len(trace),
        "belady_misses": misses,
        "lru_misses": lru_misses(trace, slots),
        "engine_disk_reads": engine["num_expert_disk_reads"],
        "miss_bytes_per_token": miss_bytes_per_token,
        "read_bytes_per_s": read["bytes_per_s"],
        "tokens_per_s": read["bytes_per_s"] / miss_bytes_per_token if miss_bytes_per_token else float("inf"),
    }


def layers_in_memory(args: argparse.Namespace) -> int:
    """Decoder layers accelerate keeps in memory for the same weight memory the engine's budgets give."""
    config = json.loads((pathlib.Path(args.model) / "config.json").read_text())
    total = sum(p.stat().st_size for p in pathlib.Path(args.model).glob("*.safetensors"))
    per_layer = total / config["num_hidden_layers"]  # embeddings are small next to a layer here
    return int((args.device_budget_mb + args.host_budget_mb) * (1 << 20) // per_layer)


def run_accelerate(args: argparse.Namespace, scratch: list[str], cgroup: Cgroup) -> dict[str, Any]:
    """accelerate with as many decoder layers in memory as the engine's budgets hold; when loading that many
    is killed by the cap, again with fewer (each attempt is recorded)."""
    attempts = []
    for layers in range(layers_in_memory(args), -1, -2):
        result = run_child("accelerate", args, ["--layers-in-memory", str(layers), *scratch], cgroup)
        result["layers_in_memory"] = layers
        attempts.append({k: v for k, v in result.items() if k != "output_token_ids"})
        if result["exit_status"] == 0:
            break
    result["attempts"] = attempts
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fallbackgate.bench.scale", description=__doc__.splitlines()[3])
    p.add_argument("--model", required=True, help="checkpoint directory (larger than --cgroup-mb)")
    p.add_argument("--json", default="bench-scale.json")
    p.add_argument("--cgroup-mb", type=int, default=8192)
    p.add_argument("--device-budget-mb", type=float, default=2048)
    p.add_argument("--host-budget-mb", type=float, default=4096)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--num-reads", type=int, default=64, help="random experts read for the bandwidth")
    p.add_argument("--scratch", default=None, help="directory for accelerate's offload folder (default: TMPDIR)")
    p.add_argument("--io-threads", type=int, default=None, help="engine threads reading experts ahead in (a)")
    p.add_argument("--skip-accelerate", action="store_true", help="skip (b), accelerate's disk offload")
    p.add_argument("--skip-in-memory", action="store_true", help="skip (d) when the machine cannot hold the model")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not (pathlib.Path(args.model) / "config.json").is_file():
        print(f"error: --model {args.model}: no config.json", file=sys.stderr)
        return 2
    if not CGROUP_ROOT.is_dir() or os.geteuid() != 0:
        print(f"error: needs root and the cgroup v1 memory controller at {CGROUP_ROOT}", file=sys.stderr)
        return 2
    cgroup = Cgroup(f"fallbackgate-bench-{os.getpid()}", args.cgroup_mb << 20)
    budgets = ["--device-budget-mb", str(args.device_budget_mb), "--host-budget-mb", str(args.host_budget_mb)]
    scratch = ["--scratch", args.scratch] if args.scratch else []
    results: dict[str, Any] = {"model": args.model, "cgroup_bytes": args.cgroup_mb << 20, "args": vars(args)}
    try:
        results["disk_read"] = run_child("diskread", args, ["--num-reads", str(args.num_reads)], cgroup)
        threads = args.io_threads if args.io_threads is not None else default_io_threads()
        results["io_threads"] = threads
        results["engine_cgroup"] = run_child("engine", args, [*budgets, "--io-threads", str(threads)], cgroup)
        other = ["--io-threads", "0" if threads else "2"]  # the other choice, for the read-ahead ratio
        results["engine_cgroup_other_io"] = run_child("engine", args, [*budgets, *other], cgroup)
        if not args.skip_accelerate:
            results["accelerate_cgroup"] = run_accelerate(args, scratch, cgroup)
        if not args.skip_in_memory:
            results["engine_in_memory"] = run_child("engine", args, [], None)
            results["engine_in_memory_unstacked"] = run_child("engine", args, ["--no-stack"], None)
            results["generate_in_memory"] = run_child("generate", args, [], None)
    finally:
        cgroup.remove()
    summarise(results)
    pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.json}")
    return 0


def summarise(results: dict[str, Any]) -> None:
    """Add the ratios and checks, and print them."""
    engine, acc = results["engine_cgroup"], results.get("accelerate_cgroup", {})
    summary: dict[str, Any] = {}
    if engine.get("exit_status") == 0:
        results["bound"] = physical_bound(engine, results["disk_read"])
        summary["engine_tokens_per_s"] = engine["tokens_per_s"]
        summary["engine_peak_cgroup_gib"] = engine["cgroup_peak_bytes"] / GIB
        summary["engine_over_bound"] = engine["tokens_per_s"] / results["bound"]["tokens_per_s"]
        uses, reads = results["bound"]["num_expert_uses"], engine["num_expert_disk_reads"]
        summary["expert_hit_rate"] = 1 - reads / uses
        summary["expert_bytes_read_per_token"] = reads * engine["bytes_per_expert"] / engine["num_output_tokens"]
    other = results.get("engine_cgroup_other_io", {})
    if other.get("exit_status") == 0 and engine.get("exit_status") == 0:
        with_threads, without = (engine, other) if results["io_threads"] else (other, engine)
        summary["read_ahead_speedup"] = with_threads["tokens_per_s"] / without["tokens_per_s"]
        summary["tokens_equal_with_and_without_read_ahead"] = other["output_token_ids"] == engine["output_token_ids"]
        summary["read_ahead_tokens_per_s"] = with_threads["tokens_per_s"]
        for key in ("hidden_fraction", "prefetch_precision", "prefetch_recall"):
            summary[f"read_ahead_{key}"] = with_threads["expert_reads"][key]
    if acc.get("exit_status") == 0 and engine.get("exit_status") == 0:
        summary["engine_over_accelerate"] = engine["tokens_per_s"] / acc["tokens_per_s"]
        summary["accelerate_peak_cgroup_gib"] = acc["cgroup_peak_bytes"] / GIB
    memory, unstacked = results.get("engine_in_memory", {}), results.get("engine_in_memory_unstacked", {})
    if unstacked.get("exit_status") == 0 and engine.get("exit_status") == 0:
        summary["tokens_equal_in_memory"] = unstacked["output_token_ids"] == engine["output_token_ids"]
    if memory.get("exit_status") == 0 and engine.get("exit_status") == 0:
        summary["tokens_equal_in_memory_stacked"] = memory["output_token_ids"] == engine["output_token_ids"]
        generate = results["generate_in_memory"]
        if generate.get("exit_status") == 0:
            summary["in_memory_engine_over_generate"] = memory["tokens_per_s"] / generate["tokens_per_s"]
    results["summary"] = summary
    for key, value in summary.items():
        print(f"{key:36s} {value:.4g}" if isinstance(value, float) else f"{key:36s} {value}")


if __name__ == "__main__":
    sys.exit(main())

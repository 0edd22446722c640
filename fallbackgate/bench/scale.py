"""python -m fallbackgate.bench.scale --model DIR --json bench-scale.json [--cgroup-mb 8192] [--ram-budget-mb 6144]
                                     [--workloads short-chat long-reasoning] [--num-prompts 4] [--max-new-tokens 64]
                                     [--quick]

A checkpoint larger than memory (e.g. ``python -m fallbackgate.synth --like olmoe-1b-7b --out DIR``, 13.5 GB
in bf16), measured in one run on this machine (root and the cgroup v1 memory controller needed), in the
RAM-and-disk regime: RAM is the one budgeted tier (``--ram-budget-mb``, the engine's device budget on a CPU)
and the disk the one link, through the engine's I/O scheduler. For each workload (``fallbackgate workload``'s
generators, seed ``--seed``, answers capped at ``--max-new-tokens``, all requests submitted at once):

(a) the engine inside a memory cgroup capped at ``--cgroup-mb`` (page cache included), exact-only, with the
    bytes every tag says it read from disk against the kernel's count (``/proc/PID/io`` ``read_bytes``);
(b) accelerate's disk offload inside the same cgroup, given the same memory (as many decoder layers as
    ``--ram-budget-mb`` holds; fewer when the cap kills it, each attempt recorded);
(c) the same engine with everything in RAM (no cgroup, experts kept one by one: the same kernels as (a)),
    for the greedy tokens and the in-memory tokens/s;
(d) the roofline ``min((c)'s tokens/s, tokens/s if the bytes Belady's MIN must read on (a)'s trace came at the
    best measured disk rate for the read size over queue depths 1-32)``, the disk rates from
    ``fallbackgate profile``'s disk table measured on the checkpoint's file system (``fallbackgate.bench.scale_bound``).
Every variant runs in its own process; ratios are computed from this one run. ``--quick`` (a small checkpoint,
e.g. ``--num-layers 2``, in a small cgroup): the profile's quick disk grid, 2 prompts, 8 new tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
from typing import Any

from fallbackgate.bench.scale_bound import roofline
from fallbackgate.bench.scale_child import drop_page_cache
from fallbackgate.engine.disk_model import DiskTable
from fallbackgate.profiling.disk import disk_grid, measure_disk_table
from fallbackgate.workloads.kinds import WorkloadKind

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


def run_child(
    variant: str, args: argparse.Namespace, workload: str, extra: list[str], cgroup: Cgroup | None
) -> dict[str, Any]:
    """Run one variant in a fresh process (inside `cgroup` when given) and return its JSON plus exit status."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
        out_path = out.name
    cmd = [sys.executable, "-m", "fallbackgate.bench.scale_child", variant, "--model", args.model, "--out", out_path]
    cmd += ["--num-prompts", str(args.num_prompts), "--max-new-tokens", str(args.max_new_tokens)]
    cmd += ["--workload", workload, "--seed", str(args.seed), *extra]
    drop_page_cache(args.model)
    if cgroup is not None:
        cgroup.reset_peak()
        script = f'echo $$ > {cgroup.path}/cgroup.procs && exec "$@"'
        cmd = ["bash", "-c", script, "bash", *cmd]
    print(f"[{workload} {variant}{' in cgroup' if cgroup else ''}] running ...", flush=True)
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


def layers_in_memory(args: argparse.Namespace) -> int:
    """Decoder layers accelerate keeps in memory for the same weight memory the engine's budgets give."""
    config = json.loads((pathlib.Path(args.model) / "config.json").read_text())
    total = sum(p.stat().st_size for p in pathlib.Path(args.model).glob("*.safetensors"))
    per_layer = total / config["num_hidden_layers"]  # embeddings are small next to a layer here
    return int(args.ram_budget_mb * (1 << 20) // per_layer)


def run_accelerate(args: argparse.Namespace, workload: str, scratch: list[str], cgroup: Cgroup) -> dict[str, Any]:
    """accelerate with as many decoder layers in memory as the engine's RAM budget holds; when loading that many
    is killed by the cap, again with fewer (each attempt is recorded)."""
    attempts = []
    for layers in range(layers_in_memory(args), -1, -2):
        result = run_child("accelerate", args, workload, ["--layers-in-memory", str(layers), *scratch], cgroup)
        result["layers_in_memory"] = layers
        attempts.append({k: v for k, v in result.items() if k != "output_token_ids"})
        if result["exit_status"] == 0:
            break
    result["attempts"] = attempts
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fallbackgate.bench.scale", description=__doc__.splitlines()[4])
    p.add_argument("--model", required=True, help="checkpoint directory (larger than --cgroup-mb)")
    p.add_argument("--json", default="bench-scale.json")
    p.add_argument("--cgroup-mb", type=int, default=8192)
    p.add_argument("--ram-budget-mb", type=float, default=6144, help="the engine's RAM budget (its device budget)")
    kinds = [k.value for k in WorkloadKind]
    p.add_argument("--workloads", nargs="+", default=["short-chat", "long-reasoning"], choices=kinds)
    p.add_argument("--seed", type=int, default=0, help="the workloads' seed")
    p.add_argument("--num-prompts", type=int, default=None, help="requests per workload (default 4; --quick 2)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="answer cap (default 64; --quick 8)")
    p.add_argument("--quick", action="store_true", help="the quick disk grid and small defaults (a small checkpoint)")
    p.add_argument("--scratch", default=None, help="directory for accelerate's offload folder (default: TMPDIR)")
    p.add_argument("--io-threads", type=int, default=None, help="engine threads reading experts ahead in (a)")
    p.add_argument("--skip-accelerate", action="store_true", help="skip (b), accelerate's disk offload")
    p.add_argument("--skip-in-memory", action="store_true", help="skip (c) when the machine cannot hold the model")
    args = p.parse_args(argv)
    args.num_prompts = args.num_prompts or (2 if args.quick else 4)
    args.max_new_tokens = args.max_new_tokens or (8 if args.quick else 64)
    if args.max_new_tokens > 64:
        p.error("--max-new-tokens: at most 64 (the issue's benchmark cells)")
    return args


def measure_workload(args: argparse.Namespace, workload: str, cgroup: Cgroup) -> dict[str, Any]:
    """(a), (b) and (c) for one workload."""
    threads = [] if args.io_threads is None else ["--io-threads", str(args.io_threads)]
    budget = ["--ram-budget-mb", str(args.ram_budget_mb), *threads, "--no-stack"]
    out: dict[str, Any] = {"engine_cgroup": run_child("engine", args, workload, budget, cgroup)}
    if not args.skip_accelerate:
        out["accelerate_cgroup"] = run_accelerate(
            args, workload, ["--scratch", args.scratch] * bool(args.scratch), cgroup
        )
    if not args.skip_in_memory:
        out["engine_in_memory"] = run_child("engine", args, workload, ["--no-stack", *threads], None)
    return out


def cannot_run(model: str) -> str | None:
    """Why a cgroup benchmark of checkpoint `model` cannot run here (None: it can)."""
    if not (pathlib.Path(model) / "config.json").is_file():
        return f"--model {model}: no config.json"
    if not CGROUP_ROOT.is_dir() or os.geteuid() != 0:
        return f"needs root and the cgroup v1 memory controller at {CGROUP_ROOT}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = pathlib.Path(args.model)
    if (why := cannot_run(args.model)) is not None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    print(f"[disk] measuring the disk table of {model.resolve()} ...", flush=True)
    table = measure_disk_table(model.resolve(), *disk_grid(args.quick))
    results: dict[str, Any] = {"model": args.model, "cgroup_bytes": args.cgroup_mb << 20, "args": vars(args)}
    results["disk_table"] = dataclasses.asdict(table)
    cgroup = Cgroup(f"fallbackgate-bench-{os.getpid()}", args.cgroup_mb << 20)
    try:
        results["workloads"] = {w: measure_workload(args, w, cgroup) for w in args.workloads}
    finally:
        cgroup.remove()
    for workload, runs in results["workloads"].items():
        runs["summary"] = summarise(runs, table)
        print(f"== {workload}")
        for key, value in runs["summary"].items():
            print(f"{key:36s} {value:.4g}" if isinstance(value, float) else f"{key:36s} {value}")
    pathlib.Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    print(f"wrote {args.json}")
    return 0


def summarise(runs: dict[str, Any], table: DiskTable) -> dict[str, Any]:
    """One workload's ratios and checks (and its roofline, into `runs`)."""
    engine, acc, memory = (runs.get(k, {}) for k in ("engine_cgroup", "accelerate_cgroup", "engine_in_memory"))
    summary: dict[str, Any] = {}
    if engine.get("exit_status") != 0:
        return {"engine_exit_status": engine.get("exit_status")}
    tagged = sum(engine["disk_bytes_by_tag"].values())
    summary["engine_tokens_per_s"] = engine["tokens_per_s"]
    summary["engine_num_output_tokens"] = engine["num_output_tokens"]
    summary["engine_peak_cgroup_gib"] = engine["cgroup_peak_bytes"] / GIB
    summary["expert_hit_rate"] = 1 - engine["num_expert_disk_reads"] / max(1, len(engine["trace"]))
    summary["tagged_disk_gib"] = tagged / GIB
    summary["kernel_read_gib"] = engine["kernel_read_bytes"] / GIB
    summary["tagged_over_kernel_bytes"] = tagged / engine["kernel_read_bytes"] if engine["kernel_read_bytes"] else None
    if acc.get("exit_status") == 0:
        summary["engine_over_accelerate"] = engine["tokens_per_s"] / acc["tokens_per_s"]
        summary["accelerate_tokens_per_s"] = acc["tokens_per_s"]
        summary["accelerate_layers_in_memory"] = acc["layers_in_memory"]
        summary["accelerate_peak_cgroup_gib"] = acc["cgroup_peak_bytes"] / GIB
    if memory.get("exit_status") == 0:
        runs["roofline"] = roofline(engine, memory["tokens_per_s"], table)
        summary["roofline_tokens_per_s"] = runs["roofline"]["tokens_per_s"]
        summary["engine_over_roofline"] = engine["tokens_per_s"] / runs["roofline"]["tokens_per_s"]
        summary["tokens_equal_in_memory"] = memory["output_token_ids"] == engine["output_token_ids"]
    return summary


if __name__ == "__main__":
    sys.exit(main())

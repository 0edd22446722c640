"""python -m fallbackgate.bench.controller_cost --json F [--reps 5] [--sizes 1k,10k,100k,qwen3-30b-a3b]

What a controller's bookkeeping costs as the device cache grows, old (the full rebuild-and-sort of
:mod:`fallbackgate.bench.victims_reference`) against new (the lazy selections over maintained structures),
in one process on the same states:

- ``choose_victims`` of the joint, exact-LRU, independent-LRU and static-split controllers: the old call
  builds and sorts the whole list, the new one is asked for the k victims a miss takes (k = 8 and 64);
- the per-step KV walks: the runner's and the joint controller's search for off-device blocks of every
  running request (old: every layer × block; new: the store's off-device index), and the joint step-end
  rebalance.

States are a real :class:`~fallbackgate.engine.kv.store.KVStore` (one-byte-wide blocks, so that 400k of them
fit in memory) behind a view with the engine's queries, and a 48-layer expert table with half the experts on
device; the running requests are pinned, as the engine pins a step's requests. Sizes: ``1k`` … ``100k``
objects on device, and ``qwen3-30b-a3b``: 48 layers × 128 experts and batch 32 × 4k tokens of 16-token
blocks (393,216 KV blocks). The state is frozen out of the garbage collector's reach (``gc.freeze``) before
timing. Medians of ``--reps`` calls; prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import pathlib
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from fallbackgate.bench import victims_reference as ref
from fallbackgate.bench.controller_cost_experts import ExpertTable, expert_rows
from fallbackgate.controllers import (
    ExactLRUController,
    IndependentLRUController,
    JointController,
    StaticSplitController,
)
from fallbackgate.controllers.joint_memory import rebalance
from fallbackgate.engine.controller import KVBlockInfo
from fallbackgate.engine.device_pool import TierPool
from fallbackgate.engine.hardware import CPU_BOX, HardwareProfile
from fallbackgate.engine.kv.block import SpillMode
from fallbackgate.engine.kv.codec import quant_kv_nbytes
from fallbackgate.engine.kv.spill import SpillDir
from fallbackgate.engine.kv.store import KVStore
from fallbackgate.engine.tags import ObjectKind, Tag, Tier
from fallbackgate.engine.view import block_info
from fallbackgate.policy.schema import Policy

# name -> (experts per layer, batch, tokens per request); 48 layers, 16-token blocks, half the experts on device
SIZES = {
    "1k": (16, 2, 64),
    "10k": (64, 8, 256),
    "100k": (128, 32, 1024),
    "qwen3-30b-a3b": (128, 32, 4096),
}
NUM_LAYERS, BLOCK_SIZE, EXPERT_BYTES = 48, 16, 3 * 2048 * 768 * 2  # Qwen3-30B-A3B expert, bf16
TAKEN = (8, 64)  # victims a miss takes


class BenchView:
    """The engine's controller queries over a real KV store and a plain expert table (see the docstring)."""

    def __init__(self, kv: KVStore, on_device: dict, homes: dict, running: tuple[str, ...]) -> None:
        self.kv, self.on_device, self.homes, self.running = kv, on_device, homes, running
        self.table = ExpertTable(on_device, homes)  # entries and the residency journal, as the store keeps them
        self.profile: HardwareProfile = CPU_BOX
        self.is_ram_tiered = False  # homes on host or disk, as on CUDA
        self.used_expert_keys: tuple = ()
        self.used_kv_block_keys: tuple = ()
        self.deferred_expert_keys: tuple = ()
        self.bytes_per_expert, self.num_layers, self.block_size = EXPERT_BYTES, kv.num_layers, kv.block_size
        self.bytes_per_kv_block = kv.bytes_per_block
        self.device_budget_bytes = sum(on_device.values()) * EXPERT_BYTES + len(kv.device_blocks()) * kv.bytes_per_block
        self.device_free_bytes = 0

    @property
    def running_ids(self) -> tuple[str, ...]:
        return self.running

    @property
    def kv_request_ids(self) -> tuple[str, ...]:
        return tuple(self.kv.tables)

    def request_class(self, request_id: str) -> str:
        return "default" if request_id in self.kv.tables else ""

    def device_used_bytes(self, kind: ObjectKind) -> int:
        if kind is ObjectKind.EXPERT:
            return sum(self.on_device.values()) * EXPERT_BYTES
        return self.kv.device_pool.used_bytes_by_kind[ObjectKind.KV_BLOCK]

    def device_expert_keys(self) -> tuple:  # as the store answers: a walk of its entries
        return tuple(k for k, is_on in self.on_device.items() if is_on)

    def kv_changes_since(self, cursor: int) -> tuple[None, int]:
        return None, -1  # no KV journal: the controller walks device_kv_blocks_of, as the engine's view

    def expert_changes_since(self, cursor: int) -> tuple[list | None, int]:
        return self.table.journal.since(cursor)

    def is_expert_on_device(self, key: tuple[int, int]) -> bool:
        return self.on_device.get(key, False)

    def expert_home(self, key: tuple[int, int]) -> Tier:
        return self.homes[key]

    def quantized_bytes(self, kind: ObjectKind, bits: int) -> int:
        return quant_kv_nbytes(self.kv.block_shape, bits, self.kv.key_dim)

    def num_kv_tokens(self, request_id: str) -> int:
        return self.kv.num_tokens.get(request_id, 0)

    def off_device_kv_blocks(self, request_id: str, num_blocks: int) -> tuple[KVBlockInfo, ...]:
        return tuple(block_info(b) for b in self.kv.off_device_blocks(request_id, num_blocks))

    def old_off_device_kv_blocks(self, request_id: str, layer: int, num_blocks: int) -> tuple[KVBlockInfo, ...]:
        """The per-layer query the joint controller made once per layer before."""
        return tuple(block_info(b) for b in self.kv.blocks(request_id, layer)[:num_blocks] if b.device is None)

    def device_kv_blocks(self) -> tuple[KVBlockInfo, ...]:
        return tuple(block_info(b) for b in self.kv.device_blocks())

    def device_kv_blocks_of(self, request_id: str, is_index_major: bool = False) -> Iterator[KVBlockInfo]:
        return (block_info(b) for b in self.kv.device_blocks_of(request_id, is_index_major))

    def prefix_entry(self, request_id: str) -> None:
        """No kept prefix blocks here."""
        return None

    def staged_kv_tag(self, key: tuple) -> Tag | None:
        return Tag.EXACT_LOAD if key in self.used_kv_block_keys else None

    def kv_quant_error_energy(self, key: tuple) -> float | None:
        return None


def build_state(size: str, spill_dir: pathlib.Path, rng: random.Random) -> tuple[BenchView, JointController, set]:
    """The KV store, expert table, frequencies and recency of one size; returns the view, a joint controller
    with frequencies, and the pinned KV (every block of the running requests)."""
    experts_per_layer, batch, tokens = SIZES[size]
    num_blocks = NUM_LAYERS * batch * -(-tokens // BLOCK_SIZE)
    pool = TierPool("device", num_blocks * BLOCK_SIZE * 2 * 4)  # 1 head, K and V 1 wide, fp32
    kv = KVStore(NUM_LAYERS, 1, 1, 1, BLOCK_SIZE, pool, TierPool("host", 0), SpillDir(spill_dir), torch.device("cpu"))
    for i in range(batch):
        kv.add_sequence(f"r{i}")
        kv.append(f"r{i}", tokens)
    for block in rng.sample(kv.device_blocks(), num_blocks // 50):  # 2 % spilled: the walks' off-device blocks
        kv.spill_block(block, SpillMode.DROP)
    keys = [(layer, e) for layer in range(NUM_LAYERS) for e in range(experts_per_layer)]
    on_device = {k: rng.random() < 0.5 for k in keys}
    homes = {k: Tier.HOST if rng.random() < 0.7 else Tier.DISK for k in keys}
    running = tuple(f"r{i}" for i in range(batch) if i % 4)  # a quarter idle, holding device KV
    view = BenchView(kv, on_device, homes, running)
    joint = JointController(Policy())
    joint.values.set_frequencies({k: rng.random() for k in keys if rng.random() < 0.6})
    used = [k for k in keys if rng.random() < 0.3]
    used_kv = [b.key for b in rng.sample(kv.device_blocks(), min(256, num_blocks // 4))]
    view.used_expert_keys, view.used_kv_block_keys = tuple(used), tuple(used_kv)
    pinned = kv.block_keys(list(running))
    return view, joint, pinned


def median_s(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def victim_rows(view: BenchView, joint: JointController, pinned: set, reps: int) -> dict[str, dict[str, float]]:
    """Old full selection against the new one asked for k victims, per controller (seconds)."""
    lru, independent, split = ExactLRUController(), IndependentLRUController(), StaticSplitController(0.5)
    for controller in (lru, independent, split):
        controller.recency.touch(view)
    none: set = set()
    cases = {
        "joint": (lambda: ref.joint_victims(joint, view, none, pinned), joint),
        "exact_lru": (lambda: ref.exact_lru_victims(lru.recency, SpillMode.HOST_FULL, view, none, pinned), lru),
        "independent_lru": (lambda: ref.independent_lru_victims(independent.recency, view, none, pinned), independent),
        "static_split": (lambda: ref.static_split_victims(split, view, none, pinned), split),
    }
    rows = {}
    for name, (old, controller) in cases.items():
        row = {"old_s": median_s(old, reps)}
        full = old()
        for k in TAKEN:
            taken = list(itertools.islice(controller.choose_victims(1, view, none, pinned), k))
            if taken != full[:k]:
                raise AssertionError(f"{name}: the new selection's first {k} victims differ from the old one's")
            row[f"new_k{k}_s"] = median_s(
                lambda c=controller, k=k: list(itertools.islice(c.choose_victims(1, view, none, pinned), k)), reps
            )
            row[f"ratio_k{k}"] = row["old_s"] / max(row[f"new_k{k}_s"], 1e-9)
        rows[name] = row
    return rows


def step_rows(view: BenchView, joint: JointController, reps: int) -> dict[str, dict[str, float]]:
    """Old full walks against the maintained index, per step (seconds), and the joint step-end rebalance."""
    kv, running = view.kv, view.running_ids
    num_read = {rid: kv.num_tokens[rid] // kv.block_size for rid in running}

    def runner_old() -> list:
        return [ref.off_device_walk(kv, rid, num_read[rid]) for rid in running]

    def runner_new() -> list:
        return [kv.off_device_blocks(rid, num_read[rid]) for rid in running]

    def queue_old() -> list:
        layers = range(view.num_layers)
        return [[b for la in layers for b in view.old_off_device_kv_blocks(r, la, num_read[r])] for r in running]

    def queue_new() -> list:
        return [list(view.off_device_kv_blocks(rid, num_read[rid])) for rid in running]

    def pinned_same() -> bool:  # the two pins hold the same keys
        old, new = ref.block_keys(kv, list(running)), kv.block_keys(list(running))
        return all((b.key in old) == (b.key in new) for t in kv.tables.values() for bs in t for b in bs)

    cases = {
        "step_pin": (lambda: ref.block_keys(kv, list(running)), lambda: kv.block_keys(list(running))),
        "runner_kv_walk": (runner_old, runner_new),
        "joint_kv_queue": (queue_old, queue_new),
        "joint_rebalance": (
            lambda: ref.rebalance(view, joint.values, 0.0, 8),
            lambda: rebalance(view, joint.values, 0.0, 8, _synced(joint, view)),
        ),
    }
    rows = {}
    for name, (old, new) in cases.items():
        if not pinned_same() if name == "step_pin" else old() != new():
            raise AssertionError(f"{name}: the new walk's result differs from the old one's")
        row = {"old_s": median_s(old, reps), "new_s": median_s(new, reps)}
        row["ratio"] = row["old_s"] / max(row["new_s"], 1e-9)
        rows[name] = row
    return rows


def _synced(joint: JointController, view: BenchView) -> Any:
    joint.ranking.sync(view, joint.values)
    return joint.ranking


def measure(size: str, reps: int, spill_dir: pathlib.Path) -> dict[str, Any]:
    """Build one size's state and time every row on it."""
    started = time.perf_counter()
    view, joint, pinned = build_state(size, spill_dir, random.Random(0))
    built_s = time.perf_counter() - started
    gc.collect()
    gc.freeze()  # the state's ~10^5-10^6 objects out of the collector's reach: time the selections, not gen-2 scans
    try:
        num_experts = len(view.device_expert_keys())
        num_blocks = len(view.kv.device_blocks())
        return {
            "size": size,
            "num_device_experts": num_experts,
            "num_device_kv_blocks": num_blocks,
            "num_objects": num_experts + num_blocks,
            "num_off_device_kv_blocks": sum(len(s) for s in view.kv.off_device.values()),
            "num_requests": len(view.kv.tables),
            "num_running": len(view.running_ids),
            "build_s": built_s,
            "choose_victims": victim_rows(view, joint, pinned, reps),
            "per_step": step_rows(view, joint, reps),
            "experts": expert_rows(view, view.table, joint.values, reps, median_s),  # last: it changes the residency
        }
    finally:
        gc.unfreeze()


def main(argv: list[str] | None = None) -> int:
    """Measure every size; print a table; write the JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--sizes", default=",".join(SIZES))
    args = p.parse_args(argv)
    sizes = args.sizes.split(",")
    unknown = [s for s in sizes if s not in SIZES]
    if unknown or args.reps < 1:
        p.error(f"unknown sizes {unknown} (known: {', '.join(SIZES)}) or --reps < 1")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            result = measure(size, args.reps, pathlib.Path(tmp))
            results.append(result)
            print(f"{size}: {result['num_device_experts']} device experts + {result['num_device_kv_blocks']} "
                  f"device KV blocks = {result['num_objects']} objects")  # fmt: skip
            for name, row in result["choose_victims"].items():
                print(f"  choose_victims {name:16s} old {row['old_s'] * 1e3:9.2f} ms  new k=8 "
                      f"{row['new_k8_s'] * 1e3:7.3f} ms ({row['ratio_k8']:8.1f}x)  "
                      f"k=64 {row['new_k64_s'] * 1e3:7.3f} ms ({row['ratio_k64']:8.1f}x)")  # fmt: skip
            for name, row in itertools.chain(result["per_step"].items(), result["experts"].items()):
                print(f"  per step {name:22s} old {row['old_s'] * 1e3:9.2f} ms  new {row['new_s'] * 1e3:8.3f} ms "
                      f"({row['ratio']:7.1f}x)")  # fmt: skip
    pathlib.Path(args.json).write_text(json.dumps({"reps": args.reps, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

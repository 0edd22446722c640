"""The benchmarks build their engines through the one assembly, with exactly the engine configuration they
spelled out before it (each expected ``EngineConfig`` below is the benchmark's former direct construction)
and the exact-only LRU controller."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterator

import pytest

from fallbackgate.assembly import Assembly
from fallbackgate.bench import decode, engine_time, gpu_check, scale_child
from fallbackgate.controllers import ExactLRUController
from fallbackgate.engine.config import MIB, EngineConfig
from fallbackgate.engine.hardware import CPU_BOX
from fallbackgate.engine.kv.store import SpillMode
from fallbackgate.sweep.belady import TraceRecorder
from fallbackgate.tinymoe import CHECKPOINT_DIR

MODEL = str(CHECKPOINT_DIR)


@pytest.fixture
def closing() -> Iterator[list[Assembly]]:
    built: list[Assembly] = []
    yield built
    for one in built:
        one.engine.close()


def _assert_same_config(built: Assembly, before: EngineConfig) -> None:
    assert built.engine.config is built.engine_config
    got, want = dataclasses.asdict(built.engine_config), dataclasses.asdict(before)
    assert got.keys() == want.keys()
    differing = {name: (got[name], want[name]) for name in want if got[name] != want[name]}
    assert differing == {}, f"fields (assembled, before) that differ: {differing}"


def _assert_exact_lru(controller: object) -> None:
    assert type(controller) is ExactLRUController
    assert controller.force == set() and controller.kv_spill_mode is SpillMode.HOST_FULL


def test_decode_bench_engine_is_assembled_as_before(closing: list[Assembly]) -> None:
    built = decode.engine_assembly(MODEL, 3)
    closing.append(built)
    _assert_same_config(built, EngineConfig(model_dir=MODEL, max_num_seqs=3))
    assert built.engine_config.profile == CPU_BOX
    _assert_exact_lru(built.controller)


@pytest.mark.parametrize(
    ("num_seqs", "max_len", "knobs"),
    [
        (4, 80, {"max_num_batched_tokens": 4 * 65}),  # scaling: one prefill step for the whole batch
        (2, 1024, {}),  # continuous batching and batch 1
        (4, 512, {"num_io_threads": 0, "device_budget_bytes": 5 * MIB}),  # read-ahead: on a CPU one RAM budget
    ],
)
def test_engine_time_engines_are_assembled_as_before(
    closing: list[Assembly], num_seqs: int, max_len: int, knobs: dict
) -> None:
    built = engine_time.engine_assembly(MODEL, num_seqs, max_len, **knobs)
    closing.append(built)
    before = EngineConfig(model_dir=MODEL, max_num_seqs=num_seqs, max_model_len=max_len, block_size=16, **knobs)
    _assert_same_config(built, before)
    assert built.engine_config.max_model_len == max_len
    _assert_exact_lru(built.controller)


def test_gpu_check_engines_are_assembled_as_before(closing: list[Assembly]) -> None:
    probe = gpu_check.probe_assembly(MODEL)
    closing.append(probe)
    before = EngineConfig(model_dir=MODEL, host_budget_bytes=0, device="cpu", block_size=16, is_stacked_when_fits=False)
    _assert_same_config(probe, before)
    assert probe.engine.kv_store.host_pool.budget_bytes == 0 and probe.engine_config.device == "cpu"
    budget = 5 * MIB
    built = gpu_check.budget_assembly(MODEL, budget, "cpu", 6)
    closing.append(built)
    before = EngineConfig(model_dir=MODEL, device_budget_bytes=budget, device="cpu", block_size=16, max_num_seqs=6)
    _assert_same_config(built, before)
    for one in (probe, built):
        _assert_exact_lru(one.controller)


@pytest.mark.parametrize(
    "flags",
    [
        {"ram_budget_mb": None, "no_stack": False, "io_threads": None},
        {"ram_budget_mb": 4.75, "no_stack": True, "io_threads": 0},
    ],
)
def test_scale_child_engine_is_assembled_as_before(closing: list[Assembly], flags: dict) -> None:
    args = argparse.Namespace(model=MODEL, num_prompts=3, **flags)
    built = scale_child.engine_assembly(args)
    closing.append(built)
    budgets = {}
    if args.ram_budget_mb is not None:  # on a CPU one RAM budget (the device budget; no host tier)
        budgets["device_budget_bytes"] = int(args.ram_budget_mb * MIB)
    before = EngineConfig(
        model_dir=MODEL,
        max_num_seqs=3,
        block_size=16,
        is_stacked_when_fits=not args.no_stack,
        num_io_threads=args.io_threads,
        **budgets,
    )
    _assert_same_config(built, before)
    assert type(built.controller) is TraceRecorder
    _assert_exact_lru(built.controller.inner)

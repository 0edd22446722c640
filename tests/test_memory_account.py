"""One memory account: every device byte the engine holds is reserved in the device pool, and the pool's
peak never passes the budget, whatever the fallbacks and preemptions of the run.

The checks compare the pool's per-kind counts with the tensors the stores really hold (block slots,
staged blocks, gathered K/V, dequantized expert copies) at every point where they exist, so a buffer
that escapes the account fails here even when the pool's own arithmetic is consistent.
"""

from __future__ import annotations

import pytest
import torch

from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.device_pool import HeldCopy, Scratch
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.engine.tags import ObjectKind, Tag
from tests.test_engine_exact import NEW_TOKENS, _prompts, sizes

FORCED = [(), ("expert_defer",), ("expert_lowbit",), ("cpu_execute",), ("kv_dequant",), ("recompute",)]


def _storages(engine: Engine) -> set[int]:
    kv = engine.kv_store
    held = [b.device for t in kv.tables.values() for bs in t for b in bs if b.device is not None]
    held += [s.tensor for s in kv.scratch.values()]
    return {t.untyped_storage().data_ptr() for t in held}


def _check_kv(engine: Engine) -> None:
    """The pool's KV kinds equal the bytes of the tensors the KV store holds; the total fits the budget."""
    pool, held = engine.kv_store.device_pool, engine.kv_store.held_device_bytes()
    assert pool.used_bytes_by_kind[ObjectKind.KV_BLOCK] == held["kv_block"]
    assert pool.used_bytes_by_kind[Scratch.KV_STAGED] == held["kv_staged"]
    assert pool.used_bytes <= pool.budget_bytes


def _instrument(engine: Engine, seen: dict[str, int]) -> None:
    """Wrap the executor's K/V gather and the store's low-bit dequantization with account checks."""
    executor, store = engine.executor, engine.expert_store
    kv_update, lowbit = executor.kv_update, store.lowbit_weights

    def checked_kv_update(layer: int, key_states: torch.Tensor, value_states: torch.Tensor):
        result = kv_update(layer, key_states, value_states)
        _check_kv(engine)
        slots = _storages(engine)
        copies = [k for k, _ in executor.layer_kv if k.untyped_storage().data_ptr() not in slots]
        for keys in (k for k, _ in executor.layer_kv if k.untyped_storage().data_ptr() in slots):
            assert keys.shape[1] <= engine.kv_store.block_size  # read in place: one block, nothing gathered
        assert sum(k.untyped_storage().nbytes() for k in copies) <= executor.num_gather_bytes_held  # K and V share
        seen["gather"] += bool(copies)
        return result

    def checked_lowbit(key):
        fetched = lowbit(key)
        dequant_bytes = store.device_pool.used_bytes_by_kind[Scratch.EXPERT_DEQUANT]
        assert fetched.weights.num_bytes <= dequant_bytes, (fetched.weights.num_bytes, dequant_bytes)
        assert store.device_pool.used_bytes <= store.device_pool.budget_bytes
        seen["dequant"] += 1
        return fetched

    executor.kv_update, store.lowbit_weights = checked_kv_update, checked_lowbit


def _run(path, force: tuple[str, ...], mode: str, budget: int, seen: dict[str, int]) -> tuple[Engine, dict[str, int]]:
    config = EngineConfig(
        model_dir=str(path),
        block_size=4,
        max_num_seqs=3,
        device_budget_bytes=budget,
        preempt_mode=mode,
        is_emulated_device_tier="cpu_execute" in force,  # a GPU machine's tag: emulated tiers on a CPU
    )
    engine = Engine(config, ExactLRUController(list(force)))
    _instrument(engine, seen)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=NEW_TOKENS)) for p in _prompts(1)]
    pool, num_steps = engine.kv_store.device_pool, 0
    while engine.has_unfinished():
        result = engine.step()
        num_steps += 1
        if num_steps == 4 and ids[1] in engine.sequences:  # a preemption in every run (unless it finished)
            engine.scheduler.preempt(engine.sequences[ids[1]])
        store = engine.expert_store
        kept_lowbit = pool.used_bytes_by_kind[HeldCopy.EXPERT_LOWBIT]  # low-bit copies are expert memory too
        assert result.num_device_bytes_expert == len(store.device_keys()) * store.bytes_per_expert + kept_lowbit
        step_scratch = [kind for kind in Scratch if kind is not Scratch.KV_WRITE_BEHIND]  # that one: to the next
        assert all(pool.used_bytes_by_kind[kind] == 0 for kind in step_scratch), "scratch outlived its step"
        behind = engine.kv_store.num_behind_bytes
        assert pool.used_bytes_by_kind[Scratch.KV_WRITE_BEHIND] == behind >= engine.kv_store.spill.num_pending_bytes
        _check_kv(engine)
    tags: dict[str, int] = {}
    for request_id in ids:
        for tag, count in engine.finished[request_id].tag_counts.items():
            tags[tag] = tags.get(tag, 0) + count
    assert engine.finished[ids[1]].num_preemptions >= 1
    return engine, tags


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_every_tag_and_preemption_stay_within_the_device_budget(mode: str, checkpoint_factory) -> None:
    path = checkpoint_factory("qwen3_moe")
    expert, block, layers, top_k = sizes(path)
    budget = 4 * expert + 12 * layers * block
    seen = {"gather": 0, "dequant": 0}
    all_tags: set[str] = set()
    peaks = dict.fromkeys(Scratch, 0)
    for force in FORCED:
        engine, tags = _run(path, force, mode, budget, seen)
        pool = engine.kv_store.device_pool
        assert pool.peak_used_bytes <= budget
        for tag in force:
            assert tags.get(tag, 0) > 0, (force, tags)
        all_tags |= set(tags)
        peaks = {kind: max(peaks[kind], pool.peak_bytes_by_kind[kind]) for kind in Scratch}
    assert all_tags == {tag.value for tag in Tag}
    del peaks[Scratch.KV_EXPAND]  # MLA's expanded K/V only (tests/test_mla_staging.py)
    del peaks[Scratch.EXPERT_PIN]  # the host pool's, CUDA only (tests/test_pinned_host_copies.py)
    del peaks[Scratch.EXPERT_LOWBIT_READ]  # persisted low-bit copies read ahead (tests/test_ram_tier_lowbit.py)
    assert all(peak > 0 for peak in peaks.values()), peaks  # every kind of scratch was really held and counted
    assert seen["gather"] > 0 and seen["dequant"] > 0


def test_a_request_that_cannot_fit_alone_is_refused_before_it_runs(checkpoint_factory) -> None:
    """A request runs when its KV fits on device, or else when one layer's K/V at a time does (per-layer
    staging); one that cannot run even so is refused up front."""
    path = checkpoint_factory("qwen3_moe")
    expert, block, layers, top_k = sizes(path)
    from fallbackgate.engine.errors import BudgetError

    minimum = top_k * expert + layers * block  # the engine's minimum: a one-block request
    engine = Engine(EngineConfig(model_dir=str(path), block_size=4, device_budget_bytes=minimum), ExactLRUController())
    engine.add_request([1, 2], SamplingParams(max_new_tokens=2))  # one block per layer: fits
    engine.add_request([1] * 16, SamplingParams(max_new_tokens=4), request_id="staged")  # per layer: fits
    with pytest.raises(BudgetError, match=r"request long: 300 tokens need \d+ B of KV blocks, and even staged"):
        engine.add_request([1] * 296, SamplingParams(max_new_tokens=4), request_id="long")
    assert "long" not in engine.sequences and engine.scheduler.step_id == 0


def test_the_ledger_keeps_the_run_memory_account(checkpoint_factory, tmp_path) -> None:
    from fallbackgate.batch.session import RunSettings
    from fallbackgate.ledger import queries
    from fallbackgate.ledger.db import open_ledger
    from fallbackgate.recording import record_and_judge

    path = checkpoint_factory("qwen3_moe")
    expert, block, layers, top_k = sizes(path)
    budget = 4 * expert + 12 * layers * block
    engine = Engine(EngineConfig(model_dir=str(path), block_size=4, device_budget_bytes=budget), ExactLRUController())
    ledger_path = str(tmp_path / "ledger.sqlite")
    recorded = record_and_judge(
        engine, ["once upon a time"], ledger_path, settings=RunSettings(model_dir=str(path), max_new_tokens=4)
    )
    with open_ledger(ledger_path, read_only=True) as ledger:
        memory = queries.get_run(ledger, recorded.run_id)["memory"]
    assert memory["device_budget_bytes"] == budget >= memory["peak_device_pool_bytes"] > 0
    assert memory["peak_device_pool_bytes_by_kind"]["kv_block"] > 0 and memory["dense_bytes"] == engine.num_dense_bytes
    assert memory["peak_host_pool_bytes"] <= memory["host_budget_bytes"]

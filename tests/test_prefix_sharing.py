"""Prefix sharing between live requests: a full exact block is adoptable once its prefill is done, while the
request that computed it still runs (one device slot, reference-counted); blocks of an aborted or
drop-preempted request are kept like on finish. Tokens equal a run without reuse on the same schedule."""

from __future__ import annotations

import dataclasses
import pathlib
import random
from collections.abc import Callable

from fallbackgate.bench.prefix_reuse import make_engine
from fallbackgate.engine.config import PreemptMode
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.kv.block import SpillMode
from fallbackgate.engine.kv.prefix_cache import PREFIX_ID
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.engine.tags import ObjectKind

SYSTEM_BLOCKS = 4  # full blocks of the shared system prompt (block_size 16)
NEW_TOKENS = 6


def _prompts(num: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(10, 4000) for _ in range(SYSTEM_BLOCKS * 16)]
    return [system + [rng.randrange(10, 4000) for _ in range(5 + 7 * i)] for i in range(num)]


def _engine(tmp_path: pathlib.Path, is_reused: bool, preempt_mode: str = PreemptMode.SWAP.value) -> Engine:
    engine = make_engine(str(tmp_path), is_reused)
    if preempt_mode != engine.config.preempt_mode:
        engine.close()
        engine = Engine(dataclasses.replace(engine.config, preempt_mode=preempt_mode), engine.controller)
    return engine


def _add(engine: Engine, prompt: list[int], request_id: str) -> None:
    engine.add_request(prompt, SamplingParams(max_new_tokens=NEW_TOKENS), request_id)


def _drain(engine: Engine) -> dict[str, list[int]]:
    while engine.has_unfinished():
        engine.step()
    return {rid: out.output_token_ids for rid, out in engine.finished.items()}


def _concurrent(engine: Engine, probe: Callable[[Engine], None] | None = None) -> dict[str, list[int]]:
    """Request a alone for one step (its prefill), then b and c while a still decodes."""
    prompts = _prompts(3)
    _add(engine, prompts[0], "a")
    engine.step()
    assert engine.sequences["a"].num_computed_tokens == len(prompts[0]) and engine.has_unfinished()
    _add(engine, prompts[1], "b")
    _add(engine, prompts[2], "c")
    engine.step()  # b and c admitted (adopting a's blocks when reuse is on) and prefilled
    if probe is not None:
        probe(engine)
    return _drain(engine)


def _device_block_bytes(engine: Engine) -> tuple[int, int]:
    """(KV block bytes the pool holds, bytes if every table's device blocks were counted per table)."""
    kv = engine.kv_store
    per_table = sum(1 for t in kv.tables.values() for bs in t for b in bs if b.device is not None)
    return kv.device_pool.used_bytes_by_kind[ObjectKind.KV_BLOCK], per_table * kv.bytes_per_block


def test_concurrent_requests_share_a_running_requests_blocks(tmp_path: pathlib.Path) -> None:
    seen: dict[str, tuple[int, int]] = {}
    off = _concurrent(_engine(tmp_path / "off", False), lambda e: seen.update(off=_device_block_bytes(e)))
    engine = _engine(tmp_path / "on", True)

    def probe(e: Engine) -> None:
        kv = e.kv_store
        seen["on"] = _device_block_bytes(e)
        shared = [rid for rid in kv.tables if rid.startswith(PREFIX_ID) and kv.holders.get(rid)]
        assert len(shared) == SYSTEM_BLOCKS and all(kv.holders[rid] == {"a", "b", "c"} for rid in shared)
        for layer in range(kv.num_layers):  # the same block objects in the three tables
            assert all(kv.blocks("a", layer)[i] is kv.blocks("b", layer)[i] is kv.blocks("c", layer)[i]
                       for i in range(SYSTEM_BLOCKS))  # fmt: skip
        assert not any(k[0] in shared for k in (b.key for b in kv.device_blocks()))  # held: never a victim
        assert kv.held_device_bytes()[ObjectKind.KV_BLOCK.value] == seen["on"][0]

    on = _concurrent(engine, probe)
    stats = engine.prefix.stats
    layers, bpb = engine.kv_store.num_layers, engine.kv_store.bytes_per_block
    engine.close()
    assert on == off
    assert stats.num_shared_blocks == stats.num_reused_blocks == 2 * SYSTEM_BLOCKS  # b and c took a's, live
    assert stats.num_reused_tokens == 2 * SYSTEM_BLOCKS * 16 and stats.num_reused_requests == 2
    assert stats.num_published_blocks >= SYSTEM_BLOCKS
    shared_bytes = 2 * SYSTEM_BLOCKS * layers * bpb  # b's and c's copies of the system prompt, not held
    assert seen["on"][0] == seen["off"][0] - shared_bytes  # a shared block is reserved once
    assert seen["on"][1] == seen["on"][0] + 3 * shared_bytes // 2  # ... though a's, b's and c's tables list it too
    assert seen["off"][0] == seen["off"][1]


def test_a_shared_block_stays_in_ram_until_one_holder_is_left(tmp_path: pathlib.Path) -> None:
    engine = _engine(tmp_path, True)
    prompts, kv = _prompts(2), engine.kv_store
    _add(engine, prompts[0], "a")
    engine.step()
    assert not [rid for rid in kv.tables if rid.startswith(PREFIX_ID)]  # a's own blocks until someone adopts them
    _add(engine, prompts[1], "b")
    engine.step()
    pid = kv.blocks("b", 0)[0].key[0]
    assert pid.startswith(PREFIX_ID) and kv.holders[pid] == {"a", "b"} and kv.blocks("a", 0)[0].key[0] == pid
    engine.executor.spill_kv((pid, 0, 0), SpillMode.DISK_FULL)
    assert kv.blocks(pid, 0)[0].device is not None and kv.blocks(pid, 0)[0].disk is None  # held: not spilled
    engine.abort_request("b")  # a is the last holder: the block is a's own again, and spillable
    block = kv.blocks("a", 0)[0]
    assert pid not in kv.tables and pid not in kv.holders and block.key == ("a", 0, 0)
    engine.executor.spill_kv(block.key, SpillMode.DISK_FULL)
    assert block.device is None and block.disk is not None
    out = _drain(engine)
    engine.close()
    assert set(out) == {"a"} and engine.prefix.summary()["num_kept_now"] >= SYSTEM_BLOCKS


def _after_leaving(tmp_path: pathlib.Path, is_reused: bool, leave: str) -> tuple[dict[str, list[int]], Engine]:
    """a prefills, then is aborted or drop-preempted; b (same system prompt) arrives afterwards."""
    mode = PreemptMode.RECOMPUTE.value if leave == "preempt" else PreemptMode.SWAP.value
    engine = _engine(tmp_path, is_reused, mode)
    prompts = _prompts(2)
    _add(engine, prompts[0], "a")
    engine.step()
    if leave == "abort":
        engine.abort_request("a")
    else:
        engine.scheduler.preempt(engine.sequences["a"])
    if is_reused:
        kv = engine.kv_store
        kept = [rid for rid in kv.tables if rid.startswith(PREFIX_ID)]
        assert len(kept) >= SYSTEM_BLOCKS and not any(kv.holders.get(rid) for rid in kept)
    _add(engine, prompts[1], "b")
    return _drain(engine), engine


def test_an_aborted_requests_blocks_are_adopted_later(tmp_path: pathlib.Path) -> None:
    off, plain = _after_leaving(tmp_path / "off", False, "abort")
    plain.close()
    on, engine = _after_leaving(tmp_path / "on", True, "abort")
    stats = engine.prefix.stats
    engine.close()
    assert on == off and set(on) == {"b"}
    assert stats.num_reused_blocks == SYSTEM_BLOCKS and stats.num_shared_blocks == 0  # nobody held them then
    assert engine.finished["b"].num_reused_tokens == SYSTEM_BLOCKS * 16


def test_a_drop_preempted_requests_blocks_are_adopted_later(tmp_path: pathlib.Path) -> None:
    off, plain = _after_leaving(tmp_path / "off", False, "preempt")
    plain.close()
    on, engine = _after_leaving(tmp_path / "on", True, "preempt")
    stats = engine.prefix.stats
    engine.close()
    assert on == off and set(on) == {"a", "b"}
    assert stats.num_reused_blocks == SYSTEM_BLOCKS and engine.finished["b"].num_reused_tokens == SYSTEM_BLOCKS * 16
    assert engine.finished["a"].num_reused_tokens == 0  # a itself rebuilt its KV by recompute on resume

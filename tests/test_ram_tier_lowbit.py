"""Low-bit expert copies under the one RAM budget on a CPU: kept copies are counted in the RAM pool and give way
when it needs room, a copy made from a disk read moves that read's bytes (the kernel's count agrees), prepared and
persisted copies are the copies a miss makes, read ahead of their use, and move half an expert's bytes."""

from __future__ import annotations

import pathlib

import pytest
import torch

from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.device_pool import HeldCopy, Scratch
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.experts.lowbit_ahead import READ_AHEAD_WINDOW
from fallbackgate.engine.experts.lowbit_cache import _parts, manifest_hash
from fallbackgate.engine.experts.manifest import MANIFEST_FILE
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.engine.tags import ObjectKind, Tag, Tier
from fallbackgate.sweep.measures import proc_io
from fallbackgate.tinymoe import CHECKPOINT_DIR
from tests.test_ram_tier import MIB, NEW_TOKENS, _prompts, _run


def test_lowbit_copies_live_in_the_one_ram_budget_and_move_only_disk_bytes() -> None:
    """Forced expert_lowbit on a CPU: a copy made from a disk read moves that read's bytes (from disk); one
    kept in RAM, or made from a resident expert, moves nothing; kept copies are counted in the RAM pool and
    give way when it needs room; the kernel's count agrees."""
    config = EngineConfig(
        model_dir=str(CHECKPOINT_DIR), device="cpu", device_budget_bytes=4 * MIB, num_io_threads=0,
        num_verified_copies_per_step=0,
    )
    engine = Engine(config, ExactLRUController([Tag.EXPERT_LOWBIT]))
    try:
        _, events, read = _run(engine)
        store = engine.expert_store
        lowbit = [e for e in events if e.tag is Tag.EXPERT_LOWBIT]
        moved = [e for e in lowbit if e.bytes_moved]
        assert moved and len(moved) < len(lowbit)  # some copies were kept in RAM and reused
        assert all(e.source_tier is Tier.DISK and e.bytes_moved % store.bytes_per_expert == 0 for e in moved)
        assert all(e.source_tier is None for e in lowbit if not e.bytes_moved)
        kept = [entry.lowbit for entry in store.entries.values() if entry.lowbit is not None]
        assert kept and len(kept) == len(store.lowbit_lru)
        low_bytes = sum(q.num_bytes for pair in kept for q in pair)
        on_device = len(store.device_keys()) * store.bytes_per_expert
        assert store.device_pool.used_bytes_by_kind[ObjectKind.EXPERT] == on_device
        assert store.device_pool.used_bytes_by_kind[HeldCopy.EXPERT_LOWBIT] == low_bytes
        assert store.device_pool.peak_used_bytes <= 4 * MIB
        tagged = sum(e.bytes_moved for e in events if e.source_tier is Tier.DISK)
        assert abs(read - tagged) <= 0.10 * tagged, (read / MIB, tagged / MIB)
        num_kept = len(kept)
        assert store.drop_lowbit(store.device_pool.budget_bytes) == num_kept  # all give way when asked
        assert store.device_pool.used_bytes_by_kind[HeldCopy.EXPERT_LOWBIT] == 0
    finally:
        engine.close()


def _lowbit_engine(cache_dir: pathlib.Path, cap_bytes: int = 1 << 30, is_prepared: bool = False) -> Engine:
    config = EngineConfig(
        model_dir=str(CHECKPOINT_DIR), device="cpu", device_budget_bytes=4 * MIB, num_io_threads=0,
        num_verified_copies_per_step=0, lowbit_cache_dir=str(cache_dir), lowbit_cache_bytes=cap_bytes,
        is_lowbit_prepared=is_prepared,
    )
    return Engine(config, ExactLRUController([Tag.EXPERT_LOWBIT]))


def test_prepared_lowbit_copies_are_the_copies_a_miss_makes_and_no_low_bit_miss_reads_an_expert(
    tmp_path: pathlib.Path,
) -> None:
    """``memory.lowbit_dir``: every expert's copy is persisted at build, byte for byte the copy a first-use
    miss makes from the checkpoint, so every low-bit miss then reads a copy (a quarter of the fp32 expert
    plus scales), never the whole expert, and the tokens are those of copies made on use."""
    on_use = _lowbit_engine(tmp_path / "on-use")
    try:
        tokens, _, _ = _run(on_use)
        cache = on_use.expert_store.lowbit_cache
        assert cache is not None and cache.slots
        made = {key: cache.get(key) for key in (tuple(map(int, name.split(":"))) for name in list(cache.slots))}
    finally:
        on_use.close()
    before = proc_io()["read_bytes"]
    prepared = _lowbit_engine(tmp_path / "prepared", is_prepared=True)
    try:
        store, cache = prepared.expert_store, prepared.expert_store.lowbit_cache
        assert cache is not None and len(cache.slots) == len(store.entries)  # before any step
        assert proc_io()["read_bytes"] - before >= len(store.entries) * store.bytes_per_expert  # read at build
        for key, copy in made.items():
            assert all(torch.equal(a, b) for a, b in zip(_parts(copy), _parts(cache.get(key)), strict=True))
        again, events, read = _run(prepared)
        assert again == tokens
        lowbit = [e for e in events if e.tag is Tag.EXPERT_LOWBIT]
        assert lowbit and all(e.bytes_moved in (0, e.count * cache.copy_bytes) for e in lowbit)
        assert any(e.bytes_moved for e in lowbit)
        tagged = sum(e.bytes_moved for e in events if e.source_tier is Tier.DISK)
        assert abs(read - tagged) <= 0.10 * tagged, (read / MIB, tagged / MIB)
    finally:
        prepared.close()


def test_persisted_lowbit_copies_are_read_ahead_of_their_use_and_counted_while_in_flight(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layer's persisted low-bit copies are queued on the disk queue before its exact rows compute, a window
    at a time: each read's buffer is counted in the budget until its copy is taken (none outlives its step),
    every persisted copy a miss reads was read ahead, and tokens and bytes are those of reading each copy at
    its use."""
    engine = _lowbit_engine(tmp_path, is_prepared=True)
    store, cache = engine.expert_store, engine.expert_store.lowbit_cache
    assert cache is not None
    started, taken, start = [], [], cache.start_read
    get = cache.get

    def counted_start(key: tuple[int, int]) -> bool:
        is_started = start(key)
        started.extend([key] if is_started else [])
        return is_started

    def counted_get(key: tuple[int, int]):
        taken.append(f"{key[0]}:{key[1]}" in cache.flights)
        return get(key)

    monkeypatch.setattr(cache, "start_read", counted_start)
    monkeypatch.setattr(cache, "get", counted_get)
    pool = store.device_pool
    try:
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=NEW_TOKENS)) for p in _prompts(engine)]
        events = []
        while engine.has_unfinished():
            events += engine.step().events
            assert pool.used_bytes_by_kind[Scratch.EXPERT_LOWBIT_READ] == 0 and not cache.flights
        tokens = [engine.finished.pop(i).output_token_ids for i in ids]
    finally:
        engine.close()
    moved = [e for e in events if e.tag is Tag.EXPERT_LOWBIT and e.bytes_moved]
    assert moved and len(started) == sum(e.bytes_moved for e in moved) // cache.copy_bytes
    assert taken and all(taken)  # every persisted copy a miss read had been queued ahead of it
    peak_read_bytes = pool.peak_bytes_by_kind[Scratch.EXPERT_LOWBIT_READ]
    assert cache.slot_bytes <= peak_read_bytes <= READ_AHEAD_WINDOW * cache.slot_bytes  # at most a window in flight
    assert pool.peak_used_bytes <= 4 * MIB
    at_use = _lowbit_engine(tmp_path, is_prepared=True)
    monkeypatch.setattr(at_use.expert_store, "start_lowbit_read", lambda key: False)
    try:
        again, events_at_use, _ = _run(at_use)
    finally:
        at_use.close()
    assert again == tokens
    disk_bytes = [sum(e.bytes_moved for e in evs if e.source_tier is Tier.DISK) for evs in (events, events_at_use)]
    assert disk_bytes[0] == disk_bytes[1]


def test_persisted_lowbit_copies_make_a_miss_read_half_the_bytes(tmp_path: pathlib.Path) -> None:
    """A second process finds the copies the first persisted: its low-bit misses read the int8 copy's bytes
    (about half the expert's), verified, counted by the kernel, tokens unchanged; a corrupted slot is dropped
    and the copy remade from the checkpoint; the cap bounds the slots."""
    first = _lowbit_engine(tmp_path)
    cache = first.expert_store.lowbit_cache
    assert cache is not None and cache.dir.parent.name == manifest_hash(CHECKPOINT_DIR / MANIFEST_FILE)
    tokens, first_events, _ = _run(first)
    first.close()
    used = {f"{e.layer}:{i}" for e in first_events if e.tag is Tag.EXPERT_LOWBIT for i in e.object_ids}
    second = _lowbit_engine(tmp_path)
    try:
        store, cache = second.expert_store, second.expert_store.lowbit_cache
        assert cache is not None and set(cache.slots) == used  # every copy made in the first run persisted
        off_device = [k for k in store.entries if not store.is_on_device(k)]
        persisted = [k for k in off_device if f"{k[0]}:{k[1]}" in cache.slots]
        not_persisted = [k for k in off_device if f"{k[0]}:{k[1]}" not in cache.slots]
        assert persisted and not_persisted  # what a low-bit miss reads first, as the controller is told:
        assert {store.lowbit_disk_bytes(k) for k in persisted} == {cache.copy_bytes}  # the persisted copy
        assert {store.lowbit_disk_bytes(k) for k in not_persisted} == {store.checkpoint_bytes_per_expert}  # whole
        again, events, read = _run(second)
        assert again == tokens
        assert store.lowbit_lru and {store.lowbit_disk_bytes(k) for k in store.lowbit_lru} == {0}  # kept in RAM
        moved = [e for e in events if e.tag is Tag.EXPERT_LOWBIT and e.bytes_moved]
        assert moved and all(e.bytes_moved == e.count * cache.copy_bytes for e in moved)
        assert cache.copy_bytes < 0.6 * store.bytes_per_expert  # int8 codes plus fp32 scales and zero points
        tagged = sum(e.bytes_moved for e in events if e.source_tier is Tier.DISK)
        assert abs(read - tagged) <= 0.10 * tagged, (read / MIB, tagged / MIB)
        assert cache.dir.name == "int8-float32"  # keyed by the compute dtype the copies were made from
        store.drop_lowbit(store.device_pool.budget_bytes)  # no copy kept in RAM: a miss goes to the slot
        unused = [k for k in persisted[1:] if not store.is_on_device(k)]
        for key in (persisted[0], next(k for k in unused if f"{k[0]}:{k[1]}" in cache.slots)):
            slot, _ = cache.slots[f"{key[0]}:{key[1]}"]
            with open(cache.slots_file, "r+b") as handle:  # plant a flipped byte in the expert's slot
                handle.seek(slot * cache.slot_bytes + 7)
                byte = handle.read(1)
                handle.seek(slot * cache.slot_bytes + 7)
                handle.write(bytes([byte[0] ^ 0xFF]))
        assert cache.get(persisted[0]) is None and f"{persisted[0][0]}:{persisted[0][1]}" not in cache.slots
        key = next(k for k in unused if f"{k[0]}:{k[1]}" in cache.slots)  # a miss meets a corrupt slot:
        fetched = store.lowbit_weights(key)  # the slot was read, then the whole expert: both counted
        assert fetched.bytes_moved == cache.slot_bytes + store.checkpoint_bytes_per_expert
        assert "corrupt" in fetched.note and f"{key[0]}:{key[1]}" in cache.slots  # remade and persisted again
    finally:
        second.close()
    small = _lowbit_engine(tmp_path / "small", cap_bytes=3 * cache.slot_bytes)
    try:
        _run(small)
        assert small.expert_store.lowbit_cache is not None and len(small.expert_store.lowbit_cache.slots) == 3
    finally:
        small.close()

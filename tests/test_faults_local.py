"""Faults stay local: a bad expert read is retried once, then the expert is quarantined; only the requests
that need it exactly fail (or defer it where their class allows), everyone else is served as a clean run
serves them, the audit calls such requests (and the run) unauditable, and an unreadable KV spill block is
rebuilt only for a class that may recompute.

Faults are planted in the reader (a read that raises EIO once) or by overwriting bytes of one expert in a
copied bundled checkpoint while the engine runs."""

from __future__ import annotations

import errno
import pathlib
import shutil

import pytest
import torch

from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.controllers.registry import make_controller
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.controller import Controller
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.experts.faults import rescale_late_defers
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.engine.tags import Tag
from fallbackgate.policy import loader
from fallbackgate.tinymoe import CHECKPOINT_DIR

NEW_TOKENS = 10
LAYER = 2  # the layer whose expert goes bad
POLICY = """
version: 1
controller: {kind: joint}
default_class: strict
classes:
  strict:
    budget: {max_mean_kl: 1.0e-6, max_p99_kl: 1.0e-6, min_top1_agreement: 1.0, max_approx_fraction: 0,
             allowed_tags: []}
  lenient:
    budget: {max_mean_kl: 10.0, max_p99_kl: 100.0, min_top1_agreement: 0.0, max_approx_fraction: 1.0,
             allowed_tags: [expert_defer, recompute]}
"""


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, 4000, (n,), generator=gen).tolist() for n in (6, 11, 4, 9, 7, 13)]


def copy_bundled(tmp_path: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(shutil.copytree(CHECKPOINT_DIR, tmp_path / "bundled"))


def disk_engine(path: pathlib.Path, controller: Controller | None = None, is_observe: bool = False) -> Engine:
    """Experts read from the checkpoint on use: room for a few experts and the KV of every request
    (`is_observe`: observe mode)."""
    probe = Engine(EngineConfig(model_dir=str(path), block_size=4, host_budget_bytes=0), ExactLRUController())
    expert, block, layers = (
        probe.expert_store.bytes_per_expert,
        probe.kv_store.bytes_per_block,
        probe.kv_store.num_layers,
    )
    probe.close()
    config = EngineConfig(
        model_dir=str(path),
        block_size=4,
        host_budget_bytes=0,
        device_budget_bytes=5 * expert + 64 * layers * block,
        is_observe=is_observe,
    )
    return Engine(config, controller or ExactLRUController())


def policy_controller() -> Controller:
    return make_controller("joint", loader.loads_policy(POLICY), top_k=2)


def submit(engine: Engine, classes: list[str] | None = None) -> list[str]:
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    classes = classes or ["default"] * len(prompts())
    return [engine.add_request(p, params, request_class=c) for p, c in zip(prompts(), classes, strict=True)]


def clean_run(path: pathlib.Path, controller: Controller | None = None, classes: list[str] | None = None):
    """Tokens per request and the experts each request routed to in LAYER, step by step."""
    engine = disk_engine(path, controller)
    engine.is_capturing = True
    ids = submit(engine, classes)
    routed: dict[str, set[int]] = {rid: set() for rid in ids}
    while engine.has_unfinished():
        result = engine.step()
        for call in result.capture.routing:
            if call.layer == LAYER:
                for owner, experts in zip(call.token_owner.tolist(), call.top_k_index.tolist(), strict=True):
                    routed[call.request_ids[owner]].update(experts)
    tokens = {rid: engine.finished[rid].output_token_ids for rid in ids}
    engine.close()
    return tokens, routed


def some_not_all(routed: dict[str, set[int]]) -> int:
    """An expert of LAYER that some requests route to and others do not."""
    counts = {e: sum(e in s for s in routed.values()) for e in range(16)}
    return max((e for e, n in counts.items() if 0 < n < len(routed)), key=lambda e: counts[e])


def overwrite_expert(engine: Engine, key: tuple[int, int]) -> None:
    """Overwrite bytes inside every tensor of expert `key` in the (copied) checkpoint's file, as a bad disk
    would; its device copy, if any, is dropped so the next use reads the file."""
    files = engine.expert_store.reader.files
    for name, index in engine.expert_store.reader.sources[key].parts:
        file, offset, num_bytes = files.byte_range(name, index)
        with open(file, "r+b") as handle:
            handle.seek(offset + num_bytes // 2)
            handle.write(b"\xa5" * 64)
    if engine.expert_store.is_on_device(key):
        engine.expert_store.evict(key)


def test_a_transient_eio_is_retried_once_and_served_exact(tmp_path, monkeypatch) -> None:
    path = copy_bundled(tmp_path)
    ref, _ = clean_run(path)
    engine = disk_engine(path)
    reader, failed_once = engine.expert_store.reader, set()
    read_raw = reader.read_raw

    def eio_once(key):  # each expert's first read fails as a bad sector does
        if key not in failed_once:
            failed_once.add(key)
            raise OSError(errno.EIO, "Input/output error")
        return read_raw(key)

    monkeypatch.setattr(reader, "read_raw", eio_once)
    ids = submit(engine)
    notes = []
    while engine.has_unfinished():
        notes += [e.note for e in engine.step().events if e.tag is Tag.EXACT_LOAD and e.note]
    assert {rid: engine.finished[rid].output_token_ids for rid in ids} == ref
    assert not engine.failed and len(reader.quarantine) == 0
    assert notes and all("read error" in n and "re-read" in n for n in notes)
    assert reader.quarantine.num_retried == reader.quarantine.num_cleared == len(failed_once)


def test_a_corrupted_expert_fails_only_the_requests_that_need_it(tmp_path) -> None:
    path = copy_bundled(tmp_path)
    ref, routed = clean_run(path)
    expert = some_not_all(routed)
    engine = disk_engine(path)
    ids = submit(engine)
    engine.step()  # mid-run: the first prefill has read experts already
    overwrite_expert(engine, (LAYER, expert))
    while engine.has_unfinished():
        engine.step()
    record = engine.expert_store.reader.quarantine.get((LAYER, expert))
    assert record is not None and record.found is not None and record.found != record.expected
    assert record.expected == engine.expert_store.reader.digests[(LAYER, expert)]
    assert all(name in record.tensors for name, _ in engine.expert_store.reader.sources[(LAYER, expert)].parts)
    failed = {rid for rid in ids if rid in engine.failed}
    assert failed and failed <= {rid for rid in ids if expert in routed[rid]}
    assert all(f"quarantined: expert {LAYER}:{expert}" in engine.failed[rid][1] for rid in failed)
    served = [rid for rid in ids if rid not in failed]
    assert served  # everyone else, routed through the same layer's other experts, is served exactly
    assert {rid: engine.finished[rid].output_token_ids for rid in served} == {rid: ref[rid] for rid in served}
    assert engine.expert_store.reader.quarantine.num_retried >= 1  # the second read was the one that counted


def test_a_class_that_allows_expert_defer_continues_without_the_quarantined_expert(tmp_path) -> None:
    path = copy_bundled(tmp_path)
    classes = ["strict", "lenient"] * 3
    ref, routed = clean_run(path, policy_controller(), classes)
    expert = some_not_all(routed)
    engine = disk_engine(path, policy_controller())
    ids = submit(engine, classes)
    overwrite_expert(engine, (LAYER, expert))  # after the engine started, before these requests' first step
    notes: dict[str, list[str]] = {}
    while engine.has_unfinished():
        for e in engine.step().events:
            if e.tag is Tag.EXPERT_DEFER and "quarantined" in e.note:  # (a deadline may defer others too)
                notes.setdefault(e.request_id, []).append(e.note)
    lenient = {rid for rid, c in zip(ids, classes, strict=True) if c == "lenient"}
    users = {rid for rid in ids if expert in routed[rid]}
    assert not lenient & set(engine.failed)  # they deferred it instead
    assert set(engine.failed) and set(engine.failed) <= users - lenient  # strict ones that needed it failed
    deferred = set(notes)
    assert deferred and deferred <= lenient & users
    assert all(f"quarantined: expert {LAYER}:{expert}" in n for rid in deferred for n in notes[rid])
    for rid in set(ids) - lenient - set(engine.failed):  # strict ones not needing it: exactly as in the clean run
        assert engine.finished[rid].output_token_ids == ref[rid]


@pytest.mark.parametrize("is_recompute_allowed", [True, False])
def test_an_unreadable_kv_spill_block_is_rebuilt_or_fails_its_request(tmp_path, is_recompute_allowed) -> None:
    path = copy_bundled(tmp_path)
    cls = "lenient" if is_recompute_allowed else "strict"
    ref, _ = clean_run(path, policy_controller(), [cls] * 6)
    engine = disk_engine(path, policy_controller())
    ids = submit(engine, [cls] * 6)
    for _ in range(3):
        engine.step()
    victim = engine.sequences[ids[1]]
    engine.scheduler.preempt(victim)  # swapped: its blocks spill (no host tier on a CPU: to disk)
    spilled = [b.disk for blocks in engine.kv_store.tables[ids[1]] for b in blocks if b.disk is not None]
    assert spilled
    record = spilled[0]
    with open(record.path, "r+b") as handle:  # one bad page in the spill file
        handle.seek(record.offset + 8)
        handle.write(b"\x5a" * 16)
    while engine.has_unfinished():
        engine.step()
    others = [rid for rid in ids if rid != ids[1]]
    assert {rid: engine.finished[rid].output_token_ids for rid in others} == {rid: ref[rid] for rid in others}
    if is_recompute_allowed:
        assert engine.finished[ids[1]].output_token_ids == ref[ids[1]] and not engine.failed
    else:
        assert set(engine.failed) == {ids[1]} and "unreadable KV spill" in engine.failed[ids[1]][1]


def test_a_late_defer_rescale_equals_renormalising_first() -> None:
    """Deferring an expert after its tokens' other experts accumulated gives what deferring it up front gives."""
    gen = torch.Generator().manual_seed(3)
    num_tokens, top_k, hidden = 5, 3, 4
    weights = torch.rand(num_tokens, top_k, generator=gen)
    outputs = torch.randn(num_tokens, top_k, hidden, generator=gen)  # each slot's expert output per token
    late = (torch.tensor([1, 3]), torch.tensor([0, 2]))  # tokens 1 and 3 lose the expert in slots 0 and 2
    out = torch.zeros(num_tokens, hidden)
    for slot in range(top_k):
        keep = torch.ones(num_tokens, dtype=torch.bool)
        if slot in (0, 2):
            keep[late[0][late[1] == slot]] = False
        out[keep] += outputs[keep, slot] * weights[keep, slot, None]
    rescale_late_defers(out, weights, [late])
    expected = weights.clone()
    expected[late] = 0.0
    expected = expected * (weights.sum(-1, keepdim=True) / expected.sum(-1, keepdim=True))
    assert torch.allclose(out, (outputs * expected[..., None]).sum(1), atol=1e-6)
    assert not torch.allclose(out, (outputs * weights[..., None]).sum(1), atol=1e-3)  # the rescale did something

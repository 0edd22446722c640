"""Planted faults the KV copy journal finds (issue 26 item 2): an exact load that names a disk copy the spill
never wrote, a kv_dequant that names a tier its quantized copy is not in, an arbitration whose choice the
step did not serve, a per-layer load counted twice, and a tier the writer rewrites. Each fault is planted
in engine or writer code, serves exactly the values an honest run would (so no diff against the baseline
shows it), and fails the gate naming the event; correct runs of the same shapes pass, and their journals
hold every copy they read."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from fallbackgate.batch.prompts import PromptSpec
from fallbackgate.batch.session import RunSettings
from fallbackgate.controllers import arbitration
from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.controller import Decision
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.kv.block import KVBlock, SpillMode, Staged
from fallbackgate.engine.kv.copies import KVCopies
from fallbackgate.engine.kv.spill import SpillRecord
from fallbackgate.engine.kv.store import KVStore
from fallbackgate.engine.messages import CopyAction
from fallbackgate.engine.model.runner import ModelRunner
from fallbackgate.engine.tags import Tag, Tier
from fallbackgate.ledger import rows as ledger_rows
from fallbackgate.ledger import writer_thread
from fallbackgate.ledger.db import open_ledger
from fallbackgate.ledger.kv_copy_queries import kv_arbitrations, kv_copy_changes
from fallbackgate.recording import RecordedRun, record_and_judge
from tests.test_arbitration_ledger import _joint_engine
from tests.test_engine_exact import sizes
from tests.test_planted_faults import NEW_TOKENS, _engine, _judge
from tests.test_planted_faults import model as model  # noqa: F401 - the shared checkpoint fixture

NOWHERE = pathlib.Path("/nonexistent/fallbackgate-fault")  # a disk copy's record that points at no file


def _tight(path: pathlib.Path, force: tuple[str, ...] = (), **knobs) -> Engine:
    """Two requests whose KV blocks do not fit beside the experts of one layer's top-k: blocks leave the
    device and are read back from their copies."""
    expert, block, layers, top_k = sizes(path)
    return _engine(path, force, device_budget_bytes=top_k * expert + 5 * layers * block, **knobs)


def _mismatches(recorded: RecordedRun) -> dict[str, list[str]]:
    return {
        v.request_id: [r for r in v.reasons if r.startswith("KV event mismatch")] for v in recorded.verdict.requests
    }


def _journal(recorded: RecordedRun, tmp_path: pathlib.Path) -> list[dict]:
    with open_ledger(str(tmp_path / "ledger.sqlite"), read_only=True) as ledger:  # where _judge records
        return kv_copy_changes(ledger, recorded.run_id)


@pytest.mark.parametrize(
    ("force", "knobs"),
    [((), {"host_budget_bytes": 0}), ((), {}), (("recompute",), {"preempt_mode": "recompute"})],
    ids=["disk", "host", "recompute"],
)
def test_correct_runs_read_only_copies_the_journal_holds(
    force, knobs, model: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    recorded = _judge(_tight(model, force, **knobs), tmp_path)
    assert recorded.verdict.passed, recorded.verdict
    journal = _journal(recorded, tmp_path)
    reads = [c for c in journal if c["action"] == CopyAction.READ.value]
    loads = [e for s in recorded.outcome.steps for e in s.events if e.tag is Tag.EXACT_LOAD and e.bytes_moved]
    kv_loads = sum(e.count for e in loads if e.object_kind.value == "kv_block")
    assert bool(kv_loads) is not bool(force) and sum(len(c["block_ids"].split(",")) for c in reads) == kv_loads
    if knobs.get("host_budget_bytes") == 0:
        assert {c["tier"] for c in journal} == {Tier.DISK.value}


@pytest.mark.parametrize("is_read_noted", [False, True], ids=["read-unnoted", "read-noted"])
def test_exact_load_from_a_disk_copy_the_spill_never_wrote(
    is_read_noted: bool, model: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _tight(model, host_budget_bytes=0)  # full copies that leave the device go to disk
    kept: dict[tuple[str, int, int], object] = {}
    write_copy, stage_exact = KVCopies._write_copy, KVStore._stage_exact

    def keep_in_ram(self: KVCopies, block: KVBlock, mode: SpillMode) -> int:
        if mode is not SpillMode.DISK_FULL or block.disk is not None or kept:
            return write_copy(self, block, mode)
        kept[block.key] = block.device.cpu().clone()  # the "spill": unbudgeted RAM, nothing written to disk
        block.disk = SpillRecord(NOWHERE, 0, block.device.dtype, tuple(block.device.shape), ())
        return self.bytes_per_block

    def load_from_ram(self: KVStore, block: KVBlock) -> Staged:
        if block.key not in kept or block.disk is None or block.disk.path != NOWHERE:
            return stage_exact(self, block)
        if is_read_noted:
            self.note_copy(CopyAction.READ, block, Tier.DISK, 0, self.bytes_per_block)
        return Staged(kept[block.key].to(self.device), Tag.EXACT_LOAD, Tier.DISK, self.bytes_per_block)

    monkeypatch.setattr(KVCopies, "_write_copy", keep_in_ram)
    monkeypatch.setattr(KVStore, "_stage_exact", load_from_ram)
    recorded = _judge(engine, tmp_path)
    ((request_id, layer, index),) = kept
    assert not recorded.verdict.passed
    assert all(v.stats is None or v.stats["max_kl"] < 1e-9 for v in recorded.verdict.requests)  # exact values
    named = _mismatches(recorded)[request_id]
    if is_read_noted:
        expected = f"read the disk full-precision copy of KV block {index} (layer {layer}), a copy never written"
    else:
        expected = "block(s) from disk, the KV store read 0 full-precision disk copies there"
    assert any(expected in r and r.startswith("KV event mismatch: ") for r in named), named


def test_kv_dequant_names_a_tier_its_quantized_copy_is_not_in(
    model: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _tight(model, ("kv_dequant",), host_budget_bytes=0)  # quantized copies go to disk
    stage_dequant, moved = KVStore._stage_dequant, []

    def say_host(self: KVStore, block: KVBlock) -> Staged:
        staged = stage_dequant(self, block)
        if staged.source_tier is Tier.DISK and not moved:
            staged.source_tier = Tier.HOST  # the same bytes, the wrong tier
            moved.append((engine.last_plan.step_id, *block.key))
        return staged

    monkeypatch.setattr(KVStore, "_stage_dequant", say_host)
    recorded = _judge(engine, tmp_path)
    step, request_id, layer, _ = moved[0]
    assert not recorded.verdict.passed
    named = _mismatches(recorded)[request_id]
    at = f"kv_dequant at step {step} (layer {layer}) counts"
    assert any(f"{at} 1 block(s) from host, the KV store read 0 quantized host" in r for r in named)
    assert any(f"{at} 0 block(s) from disk, the KV store read 1 quantized disk" in r for r in named), named


def test_correct_kv_dequant_from_disk_passes(model: pathlib.Path, tmp_path: pathlib.Path) -> None:
    recorded = _judge(_tight(model, ("kv_dequant",), host_budget_bytes=0), tmp_path)
    assert not any(_mismatches(recorded).values()), _mismatches(recorded)
    reads = [c for c in _journal(recorded, tmp_path) if c["action"] == CopyAction.READ.value]
    assert {(c["tier"], c["bits"]) for c in reads} >= {(Tier.DISK.value, 8)}


def _rebuilds_predicted_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """The premise of these checks: every late block the class may rebuild is rebuilt (with top_k expert slots a
    rebuild's expert loads would otherwise make it later than the late copy)."""
    monkeypatch.setattr(arbitration, "recompute_s", lambda *_: 0.0)


def _joint_run(path: pathlib.Path, tmp_path: pathlib.Path, allowed: list[str]) -> tuple[RecordedRun, list[dict]]:
    engine = _joint_engine(path, allowed)
    prompts = [PromptSpec(" ".join(["word"] * n), f"r{i}", "be") for i, n in enumerate((2, 4, 3))]
    settings = RunSettings(model_dir=str(path), max_new_tokens=6)
    url = str(tmp_path / "l.sqlite")
    recorded = record_and_judge(engine, prompts, url, settings=settings, budgets={"be": {}})
    engine.close()
    with open_ledger(url, read_only=True) as ledger:
        return recorded, kv_arbitrations(ledger, recorded.run_id)


@pytest.mark.parametrize("allowed", [["recompute", "expert_defer"], []], ids=["recompute", "exact-late"])
def test_arbitrated_kv_blocks_are_served_as_chosen(
    allowed, checkpoint_factory, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _rebuilds_predicted_free(monkeypatch)
    recorded, arbitrated = _joint_run(checkpoint_factory("qwen3_moe"), tmp_path, allowed)
    assert arbitrated and {a["choice"] for a in arbitrated} == {"recompute" if allowed else "exact_load"}
    assert not any(_mismatches(recorded).values()), _mismatches(recorded)


def test_an_arbitration_the_step_did_not_serve(
    checkpoint_factory, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _rebuilds_predicted_free(monkeypatch)
    path = checkpoint_factory("qwen3_moe")
    engine = _joint_engine(path, ["recompute", "expert_defer"])
    kv_action, overridden = engine.controller.kv_action, []

    def load_anyway(miss):  # the planned recompute is dropped and the late exact copy loaded instead
        decision = kv_action(miss)
        if decision.tag is Tag.RECOMPUTE and miss.exact_tier is not None and not overridden:
            overridden.append((miss.step_id, miss.request_id, miss.layer, miss.block_index))
            return Decision(Tag.EXACT_LOAD)
        return decision

    monkeypatch.setattr(engine.controller, "kv_action", load_anyway)
    prompts = [PromptSpec(" ".join(["word"] * n), f"r{i}", "be") for i, n in enumerate((2, 4, 3))]
    settings = RunSettings(model_dir=str(path), max_new_tokens=6)
    recorded = record_and_judge(engine, prompts, str(tmp_path / "l.sqlite"), settings=settings, budgets={"be": {}})
    engine.close()
    step, request_id, layer, block = overridden[0]
    assert not recorded.verdict.passed
    expected = (
        f"arbitration at step {step} chose recompute for KV block {block} (layer {layer}), but the step served it "
        "exact_load"
    )
    assert any(expected in r for r in _mismatches(recorded)[request_id]), _mismatches(recorded)


def _per_layer_engine(path: pathlib.Path, spill_dir: pathlib.Path) -> tuple[Engine, str]:
    """One request whose KV is four times the device's KV room (full copies on disk): its off-device blocks
    are staged layer by layer during the forward."""
    expert, block, layers, top_k = sizes(path)
    prompt = " ".join(["once upon a time the quick brown fox"] * 8)
    probe = Engine(EngineConfig(model_dir=str(path), block_size=4, max_num_seqs=1), ExactLRUController())
    num_tokens = len(probe.tokenizer.encode(prompt)) + NEW_TOKENS
    probe.close()
    kv_bytes = -(-num_tokens // 4) * layers * block
    config = EngineConfig(
        model_dir=str(path),
        block_size=4,
        max_num_seqs=1,
        device_budget_bytes=top_k * expert + kv_bytes // 4,
        host_budget_bytes=0,
        spill_dir=str(spill_dir),
    )
    return Engine(config, ExactLRUController()), prompt


@pytest.mark.parametrize("is_faulted", [False, True], ids=["correct", "counted-twice"])
def test_per_layer_staging_is_counted_once_per_read(
    is_faulted: bool, model: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, prompt = _per_layer_engine(model, tmp_path)
    log_staged, per_layer, doubled = ModelRunner._log_staged, [], []

    def log_twice(self: ModelRunner, log, block, staged, plan, note, *timing) -> None:
        log_staged(self, log, block, staged, plan, note, *timing)
        per_layer.append(self.is_per_layer)
        if is_faulted and self.is_per_layer and not doubled:  # the layer's read logged again: one read, 2 loads
            doubled.append((log.step_id, *block.key))
            log_staged(self, log, block, staged, plan, note, *timing)

    monkeypatch.setattr(ModelRunner, "_log_staged", log_twice)
    recorded = _judge(engine, tmp_path, prompts=[prompt])
    assert any(per_layer), "no block was staged per layer"
    if not is_faulted:
        assert recorded.verdict.passed, recorded.verdict
        return
    step, request_id, layer, _ = doubled[0]
    assert not recorded.verdict.passed
    named = _mismatches(recorded)[request_id]
    expected = f"exact_load at step {step} (layer {layer}) counts "
    assert any(expected in r and "block(s) from disk, the KV store read" in r for r in named), named


def test_writer_rewrites_an_exact_loads_tier(
    model: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _tight(model, host_budget_bytes=0)  # a host tier too small for a block: full copies go to disk
    step_rows, rewritten = ledger_rows.step_rows, []

    def host_instead_of_disk(run_id, plan, result, rows, sample_steps) -> int:
        for i, e in enumerate(result.events):
            is_kv_load = e.object_kind.value == "kv_block" and e.tag is Tag.EXACT_LOAD
            if is_kv_load and e.source_tier is Tier.DISK and not rewritten:
                result.events[i] = dataclasses.replace(e, source_tier=Tier.HOST)
                rewritten.append((e.step_id, e.request_id, e.layer, e.count))
        return step_rows(run_id, plan, result, rows, sample_steps)

    monkeypatch.setattr(ledger_rows, "step_rows", host_instead_of_disk)
    monkeypatch.setattr(writer_thread, "step_rows", host_instead_of_disk)
    recorded = _judge(engine, tmp_path)
    step, request_id, layer, count = rewritten[0]
    assert not recorded.verdict.passed
    named = _mismatches(recorded)[request_id]
    at = f"exact_load at step {step} (layer {layer}) counts"
    assert any(f"{at} {count} block(s) from host, the KV store read 0 full-precision host" in r for r in named), named

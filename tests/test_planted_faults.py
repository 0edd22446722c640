"""Planted faults: each one makes the gate fail and the verdict names the step and the tag it hid behind.

Every fault is planted with monkeypatch for one run, at (or from) a chosen step, on a random checkpoint
whose budget forces the faulted path; the run is recorded to a SQLite ledger and judged exactly as
``fallbackgate run`` does (:func:`fallbackgate.batch.recording.record_and_judge`). Exact-only runs over many
seeds pass the same gate (no false alarms): tests/test_no_false_alarm.py.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

from fallbackgate.audit.gate import RequestVerdict, RunVerdict
from fallbackgate.audit.tolerances import EQUIVALENT_TOLERANCE
from fallbackgate.batch.session import RunSettings
from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.experts.store import ExpertKey, ExpertStore, ExpertWeights, Fetched
from fallbackgate.engine.kv import codec as kv_codec
from fallbackgate.engine.model.runner import ModelRunner
from fallbackgate.engine.tags import Tag
from fallbackgate.ledger import queries
from fallbackgate.ledger.db import open_ledger
from fallbackgate.recording import RecordedRun, record_and_judge
from tests.checkpoints import make_checkpoint
from tests.test_engine_exact import sizes

PROMPTS = ["once upon a time", "the quick brown fox jumps"]
NEW_TOKENS = 8
FAULT_STEP = 4  # a decode step: steps count from 1, the first prefills both prompts
KV_BUDGET = {"max_mean_kl": 1e-3}  # int8 KV measures ~1e-6 mean KL here; the faulted scale ~5e-2


def _engine(path: pathlib.Path, force: tuple[str, ...] = (), experts: int = 4, **knobs: Any) -> Engine:
    expert, block, layers, _ = sizes(path)
    budget = knobs.pop("device_budget_bytes", experts * expert + 12 * layers * block)
    knobs.setdefault("is_emulated_device_tier", "cpu_execute" in force)  # a GPU machine's tag: emulated tiers
    config = EngineConfig(model_dir=str(path), block_size=4, max_num_seqs=2, device_budget_bytes=budget, **knobs)
    return Engine(config, ExactLRUController(force))


def _judge(engine: Engine, tmp_path: pathlib.Path, budgets: dict | None = None, prompts=PROMPTS) -> RecordedRun:
    settings = RunSettings(model_dir=engine.config.model_dir, max_new_tokens=NEW_TOKENS, seed=engine.config.seed)
    return record_and_judge(engine, prompts, str(tmp_path / "ledger.sqlite"), settings=settings, budgets=budgets)


def _culprit(verdict: RunVerdict) -> RequestVerdict:
    """The failing request whose first divergence came earliest: the one the fault hit first."""
    failed = [v for v in verdict.requests if not v.passed]
    assert failed and not verdict.passed, f"gate passed a planted fault: {verdict}"
    assert all(v.step is not None for v in failed), failed
    return min(failed, key=lambda v: v.step)


def _steps_with(recorded: RecordedRun, tag: Tag) -> list[int]:
    return [s.step_id for s in recorded.outcome.steps if any(e.tag is tag for e in s.events)]


def _at_step(engine: Engine, step: int) -> Callable[[], bool]:
    """True while the engine serves step `step` (never during the audit's exact baseline)."""

    def armed() -> bool:
        ctx = engine.executor.ctx
        is_baseline = ctx is not None and ctx.is_exact_baseline
        return not is_baseline and engine.last_plan is not None and engine.last_plan.step_id == step

    return armed


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("faults-qwen3"), seed=0)


def test_correct_int8_kv_dequant_passes_its_budget(model: pathlib.Path, tmp_path: pathlib.Path) -> None:
    recorded = _judge(_engine(model, ("kv_dequant",)), tmp_path, {"default": KV_BUDGET})
    assert recorded.verdict.passed, recorded.verdict
    assert _steps_with(recorded, Tag.KV_DEQUANT)
    assert all(0 < v.stats["mean_kl"] < KV_BUDGET["max_mean_kl"] / 100 for v in recorded.verdict.requests)


def test_wrong_dequant_scale(model: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(model, ("kv_dequant",))
    armed, dequantize = _at_step(engine, FAULT_STEP), kv_codec.dequantize

    def wrong_scale(q):
        return dequantize(dataclasses.replace(q, scales=q.scales * 1.5) if armed() else q)

    monkeypatch.setattr(kv_codec, "dequantize", wrong_scale)
    recorded = _judge(engine, tmp_path, {"default": KV_BUDGET})
    culprit = _culprit(recorded.verdict)
    assert FAULT_STEP in _steps_with(recorded, Tag.KV_DEQUANT)
    assert "mean KL" in culprit.reason and not culprit.quality_passed  # it also costs quality ...
    assert culprit.is_replay_bug and culprit.correctness_passed is False  # ... but it is a bug: the replay says so
    assert culprit.step == FAULT_STEP and "kv_block:kv_dequant" in culprit.tags, culprit


@pytest.mark.parametrize("dtype", [None, "bfloat16"])  # bf16: caught above a ~1e-4 floor, not a fixed 1e-9
def test_wrong_expert_loaded(
    dtype: str | None, model: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(model, dtype=dtype)
    armed, place, loaded_at = _at_step(engine, FAULT_STEP), ExpertStore.place, []

    def place_wrong(self: ExpertStore, key: ExpertKey) -> Fetched:
        if not armed() or self.is_on_device(key) or loaded_at:
            return place(self, key)
        layer, expert_id = key
        other = self.reader.read((layer, (expert_id + 1) % engine.model_config.num_experts))
        fetched = place(self, key)
        self.entries[key].device.gate_up.copy_(other.gate_up)  # wrong weights land in the expert's slot
        self.entries[key].device.down.copy_(other.down)
        loaded_at.append(engine.last_plan.step_id)
        return Fetched(self.entries[key].device, fetched.source_tier, fetched.bytes_moved)

    monkeypatch.setattr(ExpertStore, "place", place_wrong)
    recorded = _judge(engine, tmp_path)
    culprit = _culprit(recorded.verdict)
    assert loaded_at == [FAULT_STEP]
    assert culprit.correctness_bug and culprit.served == "exact", culprit
    assert culprit.step == FAULT_STEP and "exact_load" in culprit.tags, culprit


def _shift_one_position(engine: Engine, request_id: str) -> None:
    """Move every rebuilt K/V row one position later (position p gets p-1's K/V) in each layer."""
    kv = engine.kv_store
    for layer in range(kv.num_layers):
        staged = [kv.scratch[b.key] for b in kv.blocks(request_id, layer) if b.key in kv.scratch and b.device is None]
        rebuilt = [s for s in staged if s.tag is Tag.RECOMPUTE]
        if not rebuilt:
            continue
        rows = torch.cat([s.tensor for s in rebuilt], dim=1)
        shifted = torch.cat([rows[:, :1], rows[:, :-1]], dim=1)
        for i, s in enumerate(rebuilt):
            s.tensor.copy_(shifted[:, i * kv.block_size : (i + 1) * kv.block_size])


def test_position_offset_after_recompute(
    model: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(model, ("recompute",))
    armed, recompute, shifted_at = _at_step(engine, FAULT_STEP), ModelRunner._recompute, []

    def recompute_shifted(self: ModelRunner, step_id: int, seq, begin: int, end: int, log, is_observe: bool) -> None:
        recompute(self, step_id, seq, begin, end, log, is_observe)
        if armed():
            _shift_one_position(engine, seq.request_id)
            shifted_at.append(step_id)

    monkeypatch.setattr(ModelRunner, "_recompute", recompute_shifted)
    recorded = _judge(engine, tmp_path)
    culprit = _culprit(recorded.verdict)
    assert shifted_at and set(shifted_at) == {FAULT_STEP}
    assert culprit.correctness_bug and culprit.served == "equivalent", culprit
    assert culprit.step == FAULT_STEP and "kv_block:recompute" in culprit.tags, culprit


def _run_bf16_cpu_execute(model: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> RecordedRun:
    """Forced cpu_execute whose host weights are rounded through bfloat16 at FAULT_STEP."""
    engine = _engine(model, ("cpu_execute",))
    store, armed, rounded_at = engine.expert_store, _at_step(engine, FAULT_STEP), []
    host_weights = store.host_weights

    def host_weights_bf16(key: ExpertKey) -> Fetched:
        fetched = host_weights(key)
        if not armed():
            return fetched
        rounded_at.append(engine.last_plan.step_id)
        w = fetched.weights
        return dataclasses.replace(
            fetched, weights=ExpertWeights(w.gate_up.bfloat16().float(), w.down.bfloat16().float())
        )

    monkeypatch.setattr(store, "host_weights", host_weights_bf16)
    recorded = _judge(engine, tmp_path)
    assert rounded_at and FAULT_STEP in _steps_with(recorded, Tag.CPU_EXECUTE)
    return recorded


def test_bf16_truncation_in_cpu_execute(
    model: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    culprit = _culprit(_run_bf16_cpu_execute(model, tmp_path, monkeypatch).verdict)
    assert culprit.correctness_bug and culprit.served == "equivalent", culprit
    assert culprit.step == FAULT_STEP and "cpu_execute" in culprit.tags, culprit


def test_bf16_in_cpu_execute_is_measured_above_the_floor(
    model: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ledger does see the fault: its KL is orders of magnitude above the exact-vs-exact floor."""
    recorded = _run_bf16_cpu_execute(model, tmp_path, monkeypatch)
    with open_ledger(str(tmp_path / "ledger.sqlite"), read_only=True) as ledger:
        floor = queries.get_run(ledger, recorded.run_id)["numeric_floor_kl"]
        worst = max(queries.position_diffs(ledger, recorded.run_id, "prompt-0"), key=lambda d: d["kl"])
    assert floor < 1e-12
    assert 1e3 * max(floor, 1e-15) < worst["kl"] and worst["kl"] > EQUIVALENT_TOLERANCE  # caught by the gate
    assert worst["step_id"] == FAULT_STEP


def _flip_signs(weights: ExpertWeights) -> ExpertWeights:
    """Flip the sign of every 4th element (as a bad disk read would garble bytes)."""
    gate_up, down = weights.gate_up.clone(), weights.down.clone()
    gate_up.view(-1)[::4] *= -1
    down.view(-1)[::4] *= -1
    return ExpertWeights(gate_up, down)


def test_corrupt_disk_read_unchecked(
    model: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(model, host_budget_bytes=0)  # every expert is read from the checkpoint on use
    reader, armed, read_at = engine.expert_store.reader, _at_step(engine, FAULT_STEP), []
    assert engine.expert_store.home((0, 0)).value == "disk"
    read_raw, on_step_start = reader.read_raw, engine.controller.on_step_start

    def unchecked_from_fault_step(plan, view) -> None:
        if plan.step_id == FAULT_STEP:
            reader.is_checksum_verified = False  # the planted bug: disk reads are no longer checked
        on_step_start(plan, view)

    def garbled_read(key: ExpertKey) -> ExpertWeights:
        weights = read_raw(key)
        ctx = engine.executor.ctx
        if armed() and ctx is not None and not ctx.is_exact_baseline:
            read_at.append(engine.last_plan.step_id)
            return _flip_signs(weights)
        return weights

    monkeypatch.setattr(engine.controller, "on_step_start", unchecked_from_fault_step)
    monkeypatch.setattr(reader, "read_raw", garbled_read)
    recorded = _judge(engine, tmp_path)
    culprit = _culprit(recorded.verdict)
    assert read_at and read_at[0] == FAULT_STEP
    assert culprit.correctness_bug and culprit.served == "exact", culprit
    assert culprit.step == FAULT_STEP and "exact_load" in culprit.tags, culprit


class SlotReuseFault:
    """A slot-reuse bug: to load an expert, evict one that the same layer still reads (the expert the layer
    loaded just before, whose rows the dispatch already pointed at its slot), so the load takes the victim's
    freed slot (the free slots are a stack) while the victim's rows still read it: they compute with the
    loaded expert's weights. Planted once, at the first chance from `from_step` on; `step` records where."""

    def __init__(self, engine: Engine, from_step: int, monkeypatch: pytest.MonkeyPatch) -> None:
        self.engine, self.from_step, self.store = engine, from_step, engine.expert_store
        self.step: int | None = None  # step in which the reused slot was read
        self.loaded: dict[tuple[int, int], ExpertKey] = {}  # (step, layer) -> the layer's last load
        self._place = self.store.place
        monkeypatch.setattr(self.store, "place", self.place)

    def _armed(self) -> bool:
        ctx = self.engine.executor.ctx
        return ctx is not None and not ctx.is_exact_baseline and ctx.step_id >= self.from_step and self.step is None

    def place(self, key: ExpertKey) -> Fetched:
        ctx = self.engine.executor.ctx
        where = (ctx.step_id if ctx is not None else -1, key[0])
        earlier = self.loaded.get(where)
        if self._armed() and earlier is not None and self.store.is_on_device(earlier):
            self.store.evict(earlier)  # the layer's routing already points its rows at the slot
            self.step = ctx.step_id
        self.loaded[where] = key
        return self._place(key)


def test_evicting_an_expert_the_forward_still_needs(
    model: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(model)
    fault = SlotReuseFault(engine, FAULT_STEP, monkeypatch)
    recorded = _judge(engine, tmp_path)
    culprit = _culprit(recorded.verdict)
    assert fault.step is not None and fault.step >= FAULT_STEP, "the budget never forced the planted eviction"
    assert culprit.correctness_bug and culprit.served == "exact", culprit
    assert culprit.step == fault.step and "resident" in culprit.tags, culprit

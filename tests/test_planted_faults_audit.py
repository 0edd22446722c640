"""Planted faults the audit's independence, replay and completeness exist for (issue 14).

Each is a bug a shared-code exact baseline, a budget-only verdict or an unreconciled ledger would let
pass: a host copy corrupted after load, a recovery that returns another expert's intact bytes, dropped
ledger events, an exact-path bug on a request that also carries approximate tags, a mislabelled tag and a
KV block read from the wrong block. Each must fail the gate naming the step and the tag it hid behind.
"""

from __future__ import annotations

import pathlib

import pytest

from fallbackgate.audit.gate import RequestVerdict
from fallbackgate.engine.experts.store import ExpertKey, ExpertStore, ExpertWeights, Fetched
from fallbackgate.engine.tags import Tag
from fallbackgate.ledger import writer_thread
from fallbackgate.ledger.models import EventRow
from tests.test_planted_faults import FAULT_STEP, _at_step, _culprit, _engine, _flip_signs, _judge
from tests.test_planted_faults import model as model  # noqa: F401 - the shared checkpoint fixture

GENEROUS = {"default": {"max_mean_kl": 10.0, "max_p99_kl": 10.0}}  # any approximation's cost passes


def _corrupt_in_place(weights: ExpertWeights) -> None:
    flipped = _flip_signs(weights)
    weights.gate_up.copy_(flipped.gate_up)
    weights.down.copy_(flipped.down)


def test_host_copy_corrupted_after_load(
    model: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(model, is_emulated_device_tier=True)  # host copies: a GPU machine's tier, emulated
    store, on_step_start, corrupted = engine.expert_store, engine.controller.on_step_start, []

    def corrupt_host_copies(plan, view) -> None:
        if plan.step_id == FAULT_STEP:  # every host copy not on device: the next load serves bad bytes
            for key, entry in store.entries.items():
                if entry.host is not None and not store.is_on_device(key):
                    _corrupt_in_place(entry.host)
                    corrupted.append(key)
        on_step_start(plan, view)

    monkeypatch.setattr(engine.controller, "on_step_start", corrupt_host_copies)
    recorded = _judge(engine, tmp_path)
    culprit = _culprit(recorded.verdict)
    assert corrupted, "no host copies to corrupt"
    assert culprit.correctness_bug and culprit.served == "exact", culprit
    assert culprit.step == FAULT_STEP and "exact_load" in culprit.tags, culprit


def test_recovery_returns_another_experts_intact_bytes(
    model: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(model, host_budget_bytes=0)  # every expert is read from the checkpoint on use
    store, armed, recovered = engine.expert_store, _at_step(engine, FAULT_STEP), []
    verified_read, num_experts = store.host_cache.verified_read, engine.model_config.num_experts

    def wrong_recovery(key: ExpertKey) -> tuple[ExpertWeights, str]:
        if not armed():
            return verified_read(key)
        recovered.append(key)  # "the read failed its checksum; the re-read passed" -- of the wrong tensor
        other = store.reader.read((key[0], (key[1] + 1) % num_experts))  # intact bytes, checksum and all
        return other, "checksum failure; a re-read from the checkpoint matched the manifest"

    monkeypatch.setattr(store.read_ahead, "read", wrong_recovery)  # the store's reads go through it
    recorded = _judge(engine, tmp_path)
    culprit = _culprit(recorded.verdict)
    assert recovered
    assert culprit.correctness_bug and culprit.served == "exact", culprit
    assert culprit.step == FAULT_STEP and "exact_load" in culprit.tags, culprit


def test_dropped_ledger_events(model: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    step_rows, dropped = writer_thread.step_rows, []

    def drop_one_event(run_id, plan, result, rows, sample_steps) -> int:
        added = step_rows(run_id, plan, result, rows, sample_steps)
        if plan.step_id == FAULT_STEP:
            events = rows[EventRow.__table__]
            index = next(i for i, e in enumerate(events) if e[1] == FAULT_STEP and e[5] == "exact_load")
            dropped.append(events.pop(index))
        return added

    monkeypatch.setattr(writer_thread, "step_rows", drop_one_event)
    recorded = _judge(_engine(model), tmp_path)
    verdict = recorded.verdict
    assert dropped and not verdict.passed
    assert verdict.missing_step_ids == [FAULT_STEP], verdict
    assert any(f"steps {FAULT_STEP} " in r for r in verdict.reasons), verdict.reasons
    request_id = dropped[0][2]
    culprit = next(v for v in verdict.requests if v.request_id == request_id)
    assert not culprit.passed and culprit.correctness_passed is False
    assert any(f"at step {FAULT_STEP}:" in r for r in culprit.reasons), culprit.reasons
    assert any("exact_load" in r for r in culprit.reasons), culprit.reasons


def _place_wrong_once(engine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From FAULT_STEP, the first expert loaded gets its neighbour's weights (an exact-path bug)."""
    armed, place, loaded_at = _at_step(engine, FAULT_STEP), ExpertStore.place, []

    def place_wrong(self: ExpertStore, key: ExpertKey) -> Fetched:
        if not armed() or self.is_on_device(key) or loaded_at:
            return place(self, key)
        other = self.reader.read((key[0], (key[1] + 1) % engine.model_config.num_experts))
        fetched = place(self, key)
        self.entries[key].device.gate_up.copy_(other.gate_up)  # wrong weights land in the expert's slot
        self.entries[key].device.down.copy_(other.down)
        loaded_at.append(engine.last_plan.step_id)
        return Fetched(self.entries[key].device, fetched.source_tier, fetched.bytes_moved)

    monkeypatch.setattr(ExpertStore, "place", place_wrong)
    return loaded_at


@pytest.mark.parametrize("budgets", [GENEROUS, None], ids=["generous-budget", "no-policy"])
def test_exact_path_bug_on_a_request_with_approximate_tags(
    budgets, model: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(model, ("kv_dequant",))  # every request also carries an approximate KV tag
    loaded_at = _place_wrong_once(engine, monkeypatch)
    recorded = _judge(engine, tmp_path, budgets)
    culprit: RequestVerdict = _culprit(recorded.verdict)
    assert loaded_at == [FAULT_STEP]
    assert culprit.served == "approximate" and culprit.quality_passed, culprit  # the budget alone would pass it
    assert culprit.is_replay_bug and culprit.correctness_passed is False, culprit
    assert culprit.step == FAULT_STEP and "exact_load" in culprit.tags, culprit


def test_mislabelled_tag(model: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(model, ("expert_lowbit",), is_emulated_device_tier=True)  # host low-bit bytes: emulated
    armed, record_fetched = _at_step(engine, FAULT_STEP), engine.executor.dispatch._record_fetched

    def mislabel(uses, fetch_tag, fetched, transfer_s, wait_ns) -> None:
        if armed() and fetch_tag is Tag.EXPERT_LOWBIT:
            fetch_tag = Tag.EXACT_LOAD  # a low-bit transfer recorded as an exact load
        record_fetched(uses, fetch_tag, fetched, transfer_s, wait_ns)

    monkeypatch.setattr(engine.executor.dispatch, "_record_fetched", mislabel)
    recorded = _judge(engine, tmp_path, GENEROUS)
    verdict = recorded.verdict
    mislabelled = [r for r in verdict.reasons if r.startswith("mislabelled tag")]
    assert mislabelled and all(f"at step {FAULT_STEP} " in r for r in mislabelled), verdict.reasons
    assert "exact_load moved" in mislabelled[0] and "the bytes fit expert_lowbit" in mislabelled[0], mislabelled
    culprit = _culprit(verdict)  # and the replay, which computes an exact expert there, disagrees
    assert culprit.is_replay_bug and culprit.step == FAULT_STEP and "exact_load" in culprit.tags, culprit


def test_kv_block_read_from_the_wrong_block(
    model: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(model, experts=64)  # every expert fits: only KV is read at the fault
    kv, armed, swapped = engine.kv_store, _at_step(engine, FAULT_STEP), []
    gather = kv.gather

    def gather_wrong_block(request_id: str, layer: int, length: int):
        keys, values = gather(request_id, layer, length)
        size = kv.block_size
        end = min(2 * size, length)
        if armed() and end > size:  # block 1's positions read block 0's K/V
            keys, values = keys.clone(), values.clone()
            keys[:, size:end], values[:, size:end] = keys[:, : end - size], values[:, : end - size]
            swapped.append(request_id)
        return keys, values

    monkeypatch.setattr(kv, "gather", gather_wrong_block)
    recorded = _judge(engine, tmp_path)
    culprit = _culprit(recorded.verdict)
    assert swapped
    assert culprit.correctness_bug and culprit.served == "exact", culprit
    assert culprit.step == FAULT_STEP and "kv_block:resident" in culprit.tags, culprit


def test_copy_verification_finds_a_corrupted_host_copy_and_discards_it(
    model: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # check every copy after every step; host copies: a GPU machine's tier, emulated
    engine = _engine(model, num_verified_copies_per_step=1024, is_emulated_device_tier=True)
    store, on_step_start, corrupted = engine.expert_store, engine.controller.on_step_start, []

    def corrupt_one_host_copy(plan, view) -> None:
        if plan.step_id == FAULT_STEP:
            key = next(k for k, e in store.entries.items() if e.host is not None and not store.is_on_device(k))
            _corrupt_in_place(store.entries[key].host)
            corrupted.append(key)
        on_step_start(plan, view)

    monkeypatch.setattr(engine.controller, "on_step_start", corrupt_one_host_copy)
    recorded = _judge(engine, tmp_path)
    (key,) = corrupted
    failed = [v for s in recorded.outcome.steps for v in s.verifications if not v.passed]
    assert [(v.step_id, v.name, v.tier.value) for v in failed] == [(FAULT_STEP, f"{key[0]}:{key[1]}", "host")]
    assert "discarded" in failed[0].note  # the next use read the checkpoint again
    expected = f"weight copy corrupt: expert {key[0]}:{key[1]} (host copy)"
    assert not recorded.verdict.passed and any(r.startswith(expected) for r in recorded.verdict.reasons)
    checked = sum(len(s.verifications) for s in recorded.outcome.steps)
    assert checked > len(recorded.outcome.steps)  # many copies per step, all but one passed


def test_dense_weight_corrupted_after_load(model: pathlib.Path, tmp_path: pathlib.Path) -> None:
    engine = _engine(model)
    name, weight = next((n, p) for n, p in engine.runner.model.named_parameters() if "q_proj" in n)
    weight.data.view(-1)[::7] *= -1  # a stray write into a shared weight: serving and baselines both see it
    recorded = _judge(engine, tmp_path)
    assert not recorded.verdict.passed
    assert any(f"dense weight {name} failed its check" in r for r in recorded.verdict.reasons), recorded.verdict.reasons

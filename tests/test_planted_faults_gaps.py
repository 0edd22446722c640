"""Planted faults in the audit's remaining blind spots (issue 26): a (step, request) row the writer drops,
a KV recompute the engine logs as an exact load, a serving buffer recycled under the audit's expert
copies, and observe mode with forced tags. Each fault is planted in engine or writer code; correct runs
of the same shapes pass."""

from __future__ import annotations

import io
import pathlib
import sqlite3

import pytest
import torch

from fallbackgate.audit.table import print_table
from fallbackgate.batch.session import RunSettings
from fallbackgate.engine.controller import Decision
from fallbackgate.engine.experts.manifest import weights_digest
from fallbackgate.engine.experts.span_pool import GRANULE, SpanPool
from fallbackgate.engine.step_context import EventLog
from fallbackgate.engine.tags import ObjectKind, Tag
from fallbackgate.ledger import rows as ledger_rows
from fallbackgate.recording import record_and_judge
from tests.test_planted_faults import FAULT_STEP, PROMPTS, _engine, _judge
from tests.test_planted_faults import model as model  # noqa: F401 - the shared checkpoint fixture


@pytest.mark.parametrize(
    ("force", "knobs"),
    [((), {}), (("recompute",), {}), (("kv_dequant",), {"is_observe": True})],
    ids=["exact", "recompute", "observe-kv_dequant"],
)
def test_correct_runs_pass_the_engine_side_checks(force, knobs, model: pathlib.Path, tmp_path: pathlib.Path) -> None:
    recorded = _judge(_engine(model, force, **knobs), tmp_path)
    verdict = recorded.verdict
    assert verdict.passed, verdict
    assert verdict.missing_step_ids == [] and verdict.missing_pairs == []
    if knobs.get("is_observe"):  # observe served exactly and only noted the forced tag
        tags = {t for o in recorded.outcome.outputs for t in o.tag_counts}
        assert Tag.KV_DEQUANT.value not in tags, tags


def test_observe_with_a_forced_tag_never_decided_still_fails(
    model: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(model, ("expert_defer",), is_observe=True)
    expert_action = engine.controller.expert_action

    def never_defer(miss):  # the forced tag is lost before the controller decides it
        decision = expert_action(miss)
        return Decision(Tag.EXACT_LOAD) if decision.tag is Tag.EXPERT_DEFER else decision

    monkeypatch.setattr(engine.controller, "expert_action", never_defer)
    verdict = _judge(engine, tmp_path).verdict
    assert not verdict.passed
    expected = "forced tag expert_defer produced no events: the controller neither"
    assert any(r.startswith(expected) for r in verdict.reasons), verdict.reasons


def test_writer_drops_a_step_request_row(
    model: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    step_request_rows, dropped = ledger_rows._step_request_rows, []

    def drop_one(run_id, plan, result):
        out = step_request_rows(run_id, plan, result)
        if plan.step_id == FAULT_STEP:
            dropped.append(out.pop(1))  # the second request's row; its events are still written
        return out

    monkeypatch.setattr(ledger_rows, "_step_request_rows", drop_one)
    recorded = _judge(_engine(model), tmp_path)  # exact-only: no request is replayed
    verdict = recorded.verdict
    request_id = dropped[0][2]
    assert not verdict.passed
    assert verdict.missing_pairs == [(FAULT_STEP, request_id)], verdict.missing_pairs
    assert FAULT_STEP in verdict.missing_step_ids
    culprit = next(v for v in verdict.requests if v.request_id == request_id)
    assert culprit.correctness_passed is False and culprit.served == "exact"
    assert any(f"no step_requests row for step {FAULT_STEP}" in r for r in culprit.reasons), culprit.reasons
    assert any("computed by no recorded step" in r for r in culprit.reasons), culprit.reasons
    assert all(v.passed for v in verdict.requests if v.request_id != request_id)
    table = io.StringIO()
    print_table(verdict, table)
    assert f"missing (step, request) rows: (step {FAULT_STEP}, request {request_id})" in table.getvalue()
    assert f"ledger incomplete at steps {FAULT_STEP}" in table.getvalue()


def test_a_trace_the_replay_cannot_follow_fails_with_the_replays_reason(
    model: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A low-bit request (so it is replayed) whose step row the writer drops: the replay cannot follow its
    trace, and the verdict and the ledger say why, not only 'max KL inf'."""
    step_request_rows = ledger_rows._step_request_rows

    def drop_second(run_id, plan, result):
        out = step_request_rows(run_id, plan, result)
        return [r for i, r in enumerate(out) if not (plan.step_id == FAULT_STEP and i == 1)]

    monkeypatch.setattr(ledger_rows, "_step_request_rows", drop_second)
    recorded = _judge(_engine(model, ("expert_lowbit",)), tmp_path)
    culprit = next(v for v in recorded.verdict.requests if any("cannot follow" in r for r in v.reasons))
    reason = next(r for r in culprit.reasons if "cannot follow" in r)
    assert culprit.is_replay_bug and culprit.correctness_passed is False, culprit
    assert "max KL inf" not in " ".join(culprit.reasons) and len(reason) > len("...cannot follow ...: ") + 20
    with sqlite3.connect(tmp_path / "ledger.sqlite") as conn:
        (error,) = conn.execute(
            "SELECT replay_error FROM request_stats WHERE request_id = ?", (culprit.request_id,)
        ).fetchone()
    assert error and reason.endswith(error), (reason, error)


@pytest.mark.parametrize("every_layer", [False, True], ids=["one-layer", "every-layer"])
def test_recompute_logged_as_an_exact_load(
    every_layer: bool, model: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(model, ("recompute",))
    mislabelled: list[tuple[int, str, int]] = []
    add_transfer = EventLog.add_transfer

    def mislabel(self, profile, request_id, layer, kind, tag, bytes_moved, source_tier, **kw) -> None:
        first = mislabelled[0][:2] if mislabelled else (self.step_id, request_id)
        is_target = (self.step_id, request_id) == first if every_layer else not mislabelled
        if kind is ObjectKind.KV_BLOCK and tag is Tag.RECOMPUTE and is_target:
            tag, kw["object_id"] = Tag.EXACT_LOAD, None  # an exact load names no blocks
            mislabelled.append((self.step_id, request_id, layer))
        add_transfer(self, profile, request_id, layer, kind, tag, bytes_moved, source_tier, **kw)

    monkeypatch.setattr(EventLog, "add_transfer", mislabel)
    verdict = _judge(engine, tmp_path).verdict
    step, request_id, layer = mislabelled[0]
    assert not verdict.passed and (len(mislabelled) > 1) is every_layer
    culprit = next(v for v in verdict.requests if v.request_id == request_id)
    named = [r for r in culprit.reasons if r.startswith("KV event mismatch")]
    assert any(f"exact_load at step {step} (layer {layer}) loaded from tier None and moved 0 B" in r for r in named)
    rebuild = [r for r in named if f"step {step} ran a KV rebuild pass" in r]
    assert bool(rebuild) is every_layer, named  # with every layer relabelled, no recompute names the pass


def test_every_request_with_off_device_kv_is_audited_whatever_the_rate(
    model: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    engine = _engine(model, ("kv_dequant",))
    prompts = [*PROMPTS, "a princess lived in a castle", "over the lazy dog"]
    settings = RunSettings(model_dir=engine.config.model_dir, max_new_tokens=8, seed=engine.config.seed)
    recorded = record_and_judge(
        engine, prompts, str(tmp_path / "ledger.sqlite"), settings=settings, audit_rate=1e-6, budgets=None
    )
    outputs = recorded.outcome.outputs
    kv_readers = [o.request_id for o in outputs if o.tag_counts.get("kv_dequant") or o.tag_counts.get("recompute")]
    assert len(kv_readers) >= 2, kv_readers  # the seeded sample alone would audit one
    audited = {v.request_id for v in recorded.verdict.requests if v.stats is not None}
    assert set(kv_readers) <= audited, (kv_readers, audited)


# --- the audit's own expert copies ---------------------------------------------------------------------------
def _mapping_ranges(pool: SpanPool) -> list[tuple[int, int]]:
    return [(torch.frombuffer(m, dtype=torch.uint8).data_ptr(), len(m)) for g in pool.groups.values() for m in g]


def _recycle_in_use(pool_get):
    """A recycling bug: the pool hands out a mapping of the size even while tensors still view it."""

    def get(self: SpanPool, num_bytes: int):
        size = -(-max(num_bytes, 1) // GRANULE) * GRANULE
        group = self.groups.get(size)
        return group[0] if group else pool_get(self, num_bytes)

    return get


def test_audit_copies_share_no_storage_and_survive_a_recycled_serving_buffer(
    model: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(model, host_budget_bytes=0)  # serving reads every expert through the span pool
    reader, audit = engine.expert_store.reader, engine.executor.audit_weights
    tokens = [[5, 17, 42, 99, 7, 3, 250, 12, 64, 31]]
    before = engine.exact_hidden(tokens).clone()
    assert audit.num_reads > 0
    own = audit.storages()
    for start, length in _mapping_ranges(reader.files.spans):
        assert not any(start <= t.untyped_storage().data_ptr() < start + length for t in own)
    for entry in engine.expert_store.entries.values():
        for copy in (entry.host, entry.device):
            if copy is not None:
                serving = {copy.gate_up.untyped_storage().data_ptr(), copy.down.untyped_storage().data_ptr()}
                assert not serving & {t.untyped_storage().data_ptr() for t in own}
    monkeypatch.setattr(SpanPool, "get", _recycle_in_use(SpanPool.get))
    first = reader.read((0, 0))
    digest = weights_digest(first)
    for key in sorted(reader.sources):  # serving reads after the audit filled its cache
        reader.read(key)
    assert weights_digest(first) != digest, "the planted recycling bug did not overwrite a serving view"
    num_reads = audit.num_reads
    after = engine.exact_hidden(tokens)
    assert audit.num_reads == num_reads  # every expert came from the audit's cache ...
    assert torch.equal(before, after)  # ... unchanged by the recycled buffers
    assert engine.verify_audit_copies() == []


def test_a_changed_audit_copy_is_found_discarded_and_read_again(model: pathlib.Path) -> None:
    engine = _engine(model)
    audit = engine.executor.audit_weights
    weights = audit.get((1, 3), engine.device)
    weights.down.view(-1)[::5] *= -1  # a stray write into the audit's copy
    (failed,) = engine.verify_audit_copies()
    assert (failed.name, failed.passed, failed.object_kind) == ("1:3", False, "expert")
    assert "changed after it was filled" in failed.note
    num_reads = audit.num_reads
    again = audit.get((1, 3), engine.device)
    assert audit.num_reads == num_reads + 1
    assert weights_digest(again) == engine.expert_store.reader.digests[(1, 3)]


def test_sampled_uses_recheck_the_copy(model: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fallbackgate.engine.baseline import expert_copies

    monkeypatch.setattr(expert_copies, "CHECK_EVERY", 2)
    engine = _engine(model)
    audit = engine.executor.audit_weights
    audit.get((0, 1), engine.device).gate_up.view(-1)[0] += 1.0
    audit.get((0, 1), engine.device)  # the first reuse: not checked
    num_reads = audit.num_reads
    audit.get((0, 1), engine.device)  # the second: checked, found changed, read again
    assert audit.num_checks == 1 and audit.num_reads == num_reads + 1
    assert [f.name for f in audit.failures] == ["0:1"]

"""``fallbackgate run`` with one expert of the bundled checkpoint unreadable (a fault planted in the reader: every
read of it returns flipped bytes): the run completes, the requests that needed it have failed rows, the rest
are served and audited, and the gate calls the failed requests and the run unauditable, never PASS."""

from __future__ import annotations

import json
import pathlib

from sqlalchemy import select

from fallbackgate import cli
from fallbackgate.audit.worker import audit_loop
from fallbackgate.batch.prompts import PromptSpec
from fallbackgate.batch.session import RunSettings
from fallbackgate.engine.experts.reader import ExpertReader
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.engine.tags import Tag
from fallbackgate.ledger import queries
from fallbackgate.ledger.db import open_ledger
from fallbackgate.ledger.models import QuarantineRow, Request, Step
from fallbackgate.policy import loader
from fallbackgate.recording import record_and_judge
from tests.test_faults_local import (
    LAYER,
    POLICY,
    copy_bundled,
    disk_engine,
    overwrite_expert,
    policy_controller,
    some_not_all,
)

TEXTS = [
    "Once upon a time there was a little girl",
    "The king called his three sons to him and said,",
    "It was a cold winter morning, and the snow lay deep",
    "The old man sat by the fire and told a story",
    "A fox saw a bunch of grapes hanging from a vine",
]
NEW_TOKENS = 6


def routed_experts(path: pathlib.Path, texts: list[str] = TEXTS, num_tokens: int = NEW_TOKENS) -> dict[str, set[int]]:
    """The experts of LAYER each prompt (ids p0, p1, ...) routes to when served exactly (a clean run)."""
    engine = disk_engine(path)
    engine.is_capturing = True
    params = SamplingParams(max_new_tokens=num_tokens, stop_token_ids=(engine.tokenizer.eos_token_id,))
    ids = [engine.add_request(engine.tokenizer.encode(t), params, f"p{i}") for i, t in enumerate(texts)]
    routed: dict[str, set[int]] = {rid: set() for rid in ids}
    while engine.has_unfinished():
        for call in engine.step().capture.routing:
            if call.layer == LAYER:
                for owner, experts in zip(call.token_owner.tolist(), call.top_k_index.tolist(), strict=True):
                    routed[call.request_ids[owner]].update(experts)
    engine.close()
    return routed


def test_run_records_failed_rows_and_the_gate_says_unauditable(tmp_path, monkeypatch) -> None:
    path = copy_bundled(tmp_path)
    routed = routed_experts(path)
    expert = some_not_all(routed)
    read_raw = ExpertReader.read_raw

    def bad_expert(self, key):  # a bad sector under one expert: every read of it returns other bytes
        weights = read_raw(self, key)
        if key == (LAYER, expert):
            weights.gate_up.view(-1)[3] += 1.0
        return weights

    monkeypatch.setattr(ExpertReader, "read_raw", bad_expert)
    (tmp_path / "policy.yaml").write_text(POLICY)
    lines = [json.dumps({"id": f"p{i}", "prompt": t}) for i, t in enumerate(TEXTS)]
    (tmp_path / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    ledger_path = tmp_path / "ledger.sqlite"
    args = ["run", "--model", str(path), "--policy", str(tmp_path / "policy.yaml"), "--prompts",
            str(tmp_path / "prompts.jsonl"), "--ledger", str(ledger_path), "--device-budget-mb", "3",
            "--max-new-tokens", str(NEW_TOKENS), "--quiet"]  # fmt: skip
    assert cli.main(args) == 1  # the engine did not exit; the gate refuses a PASS
    users = {rid for rid, experts in routed.items() if expert in experts}
    with open_ledger(str(ledger_path), read_only=True) as ledger:
        run_id = queries.latest_run_id(ledger)
        assert queries.get_run(ledger, run_id)["status"] == "complete"
        with ledger.engine.connect() as conn:
            status = dict(
                conn.execute(select(Request.request_id, Request.status).where(Request.run_id == run_id)).all()
            )
            rows = conn.execute(select(QuarantineRow.__table__).where(QuarantineRow.run_id == run_id)).mappings().all()
        assert {rid for rid, s in status.items() if s == "failed"} == users
        assert {rid for rid, s in status.items() if s == "finished"} == set(routed) - users
        (thing,) = [r for r in rows if r["request_id"] is None]
        assert thing["object_id"] == f"{LAYER}:{expert}" and thing["detail"]["found"] != thing["detail"]["expected"]
        assert any(name.endswith(f"experts.{expert}.gate_proj.weight") for name in thing["detail"]["tensors"])
        verdicts = {v["request_id"]: v for v in queries.verdicts(ledger, run_id)}
        why = f"unauditable (quarantined: expert {LAYER}:{expert})"
        for rid in users:
            assert not verdicts[rid]["passed"] and verdicts[rid]["reason"] == why
        for rid in set(routed) - users:
            assert verdicts[rid]["passed"], verdicts[rid]["reason"]
        assert {r["request_id"] for r in rows if r["effect"] == "failed"} == users
        assert not verdicts[None]["passed"] and why in verdicts[None]["reason"]


def test_an_audit_worker_cannot_use_a_quarantined_expert(tmp_path, monkeypatch) -> None:
    """Served cleanly, audited after the expert went bad: the worker's baseline cannot read it, so the requests
    that need it are unauditable (not PASS), and so is the run; the others are audited and pass."""
    path = copy_bundled(tmp_path)
    routed = routed_experts(path)
    expert = some_not_all(routed)
    (tmp_path / "policy.yaml").write_text(POLICY + "audit: {sample_rate: 1.0}\n")
    lines = [json.dumps({"id": f"p{i}", "prompt": t}) for i, t in enumerate(TEXTS)]
    (tmp_path / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    ledger_path = tmp_path / "ledger.sqlite"
    args = ["run", "--model", str(path), "--policy", str(tmp_path / "policy.yaml"), "--prompts",
            str(tmp_path / "prompts.jsonl"), "--ledger", str(ledger_path), "--device-budget-mb", "3",
            "--max-new-tokens", str(NEW_TOKENS), "--quiet", "--audit", "deferred"]  # fmt: skip
    assert cli.main(args) == 0
    read_raw = ExpertReader.read_raw

    def bad_expert(self, key):
        weights = read_raw(self, key)
        if key == (LAYER, expert):
            weights.gate_up.view(-1)[3] += 1.0
        return weights

    monkeypatch.setattr(ExpertReader, "read_raw", bad_expert)  # the disk went bad before the audit
    audit_loop(str(ledger_path), lease_s=60.0, run_id=None, max_tasks=None)
    users = {rid for rid, experts in routed.items() if expert in experts}
    with open_ledger(str(ledger_path), read_only=True) as ledger:
        run_id = queries.latest_run_id(ledger)
        verdicts = {v["request_id"]: v for v in queries.verdicts(ledger, run_id)}
    why = f"unauditable (quarantined: expert {LAYER}:{expert})"
    assert {rid for rid in routed if verdicts[rid]["reason"] == why} == users
    assert all(verdicts[rid]["passed"] for rid in set(routed) - users)
    assert not verdicts[None]["passed"] and why in verdicts[None]["reason"]


def test_observe_mode_counts_a_forced_defer_as_served(tmp_path) -> None:
    """Observe mode serves exactly except where a fault leaves no exact action: a lenient request that
    deferred a quarantined expert was served that defer, and the ledger and the gate count it as served
    (approximate, unauditable), never as an exact-only request."""
    path = copy_bundled(tmp_path)
    routed = routed_experts(path)
    expert = some_not_all(routed)
    engine = disk_engine(path, policy_controller(), is_observe=True)
    overwrite_expert(engine, (LAYER, expert))
    specs = [PromptSpec(t, f"p{i}", "lenient") for i, t in enumerate(TEXTS)]
    settings = RunSettings(model_dir=str(path), max_new_tokens=NEW_TOKENS, seed=engine.config.seed)
    budgets = {name: c.budget.model_dump() for name, c in loader.loads_policy(POLICY).classes.items()}
    recorded = record_and_judge(engine, specs, str(tmp_path / "ledger.sqlite"), settings=settings, budgets=budgets)
    events = [
        (s.step_id, e)
        for s in recorded.outcome.steps
        for e in s.events
        if e.tag is Tag.EXPERT_DEFER and f"quarantined: expert {LAYER}:{expert}" in e.note
    ]
    forced = {(step_id, e.request_id) for step_id, e in events}
    assert all(e.predicted_cost > 0 for _, e in events)  # served, so its predicted cost is kept
    users = {rid for rid, experts in routed.items() if expert in experts}
    assert {rid for _, rid in forced} == users and not engine.failed  # deferred, not failed
    with open_ledger(str(tmp_path / "ledger.sqlite"), read_only=True) as ledger:
        with ledger.engine.connect() as conn:
            observed = conn.execute(select(Step.step_id, Step.is_observe).where(Step.run_id == recorded.run_id))
            assert {step_id for step_id, is_observe in observed if is_observe} >= {step for step, _ in forced}
        exactness = queries.request_exactness(ledger, recorded.run_id)
    assert all(exactness[rid].get("approximate", 0) > 0 for rid in users), exactness
    assert all("approximate" not in exactness[rid] for rid in set(routed) - users), exactness
    verdicts = {v.request_id: v for v in recorded.verdict.requests}
    why = f"unauditable (quarantined: expert {LAYER}:{expert})"
    for rid in users:
        assert verdicts[rid].served.value == "approximate" and not verdicts[rid].passed
        assert why in verdicts[rid].reasons, verdicts[rid].reasons
        assert not any("correctness bug" in r for r in verdicts[rid].reasons), verdicts[rid].reasons

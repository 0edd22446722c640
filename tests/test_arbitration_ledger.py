"""Arbitration decisions reach the ledger: a joint run under a forced dual miss (KV spilled off device, expert
misses, a TPOT target no exact copy meets) writes one row per decision with its options, its predicted and
measured arrival against the step's deadline, the stall and the audited cost; and the 0008 migration goes up
and down."""

from __future__ import annotations

import pathlib
import re

import pytest
from alembic import command
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text

from fallbackgate.batch.prompts import PromptSpec
from fallbackgate.batch.session import RunSettings
from fallbackgate.controllers import make_controller
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.hardware import HardwareProfile
from fallbackgate.engine.tags import ObjectKind, Tag
from fallbackgate.ledger.arbitration_queries import run_arbitrations
from fallbackgate.ledger.db import alembic_config, open_ledger
from fallbackgate.policy.schema import SLO, Policy, QualityBudget, RequestClass
from fallbackgate.recording import record_and_judge
from tests.test_engine_exact import sizes

SLOW = HardwareProfile("slow-link", 5e7, 5e7, 2e7, 2e7, 4e10, 4e10, 1e-6)


def _joint_engine(path: pathlib.Path, allowed: list[str]) -> Engine:
    expert, block, layers, top_k = sizes(path)
    budget = QualityBudget(
        max_mean_kl=5.0, max_p99_kl=50.0, max_approx_fraction=1.0, allowed_tags=allowed, min_top1_agreement=0.0
    )
    policy = Policy(classes={"be": RequestClass(slo=SLO(tpot_ms=0.05, ttft_ms=1.0), budget=budget)}, default_class="be")
    # the expert floor (top_k slots) and room for fewer KV blocks than the three requests reach: one is swapped
    # out to host (full copies) and its blocks are read back from there when it resumes
    config = EngineConfig(
        model_dir=str(path), block_size=4, max_num_seqs=3, device_budget_bytes=top_k * expert + 9 * layers * block
    )
    config.profile = SLOW
    return Engine(config, make_controller("joint", policy, top_k=top_k))


@pytest.mark.parametrize("allowed", [["recompute", "expert_defer"], []])
def test_a_joint_run_under_dual_misses_records_each_arbitration(
    checkpoint_factory, tmp_path: pathlib.Path, allowed: list[str]
) -> None:
    path = checkpoint_factory("qwen3_moe")
    engine = _joint_engine(path, allowed)
    prompts = [PromptSpec(" ".join(["word"] * n), f"r{i}", "be") for i, n in enumerate((2, 4, 3))]
    settings = RunSettings(model_dir=str(path), max_new_tokens=6)
    url = str(tmp_path / "ledger.sqlite")
    # audit rate 0: the audit by risk still takes every request that read KV off device (all arbitrated ones)
    recorded = record_and_judge(engine, prompts, url, settings=settings, budgets={"be": {}}, audit_rate=0.0)
    decided = engine.controller.arbitrations
    engine.close()
    with open_ledger(url, read_only=True) as ledger:
        rows = run_arbitrations(ledger, recorded.run_id)
    assert decided and len(rows) == len(decided)  # every decision in memory is in the ledger, once
    for row, arbitration in zip(rows, decided, strict=True):
        key = (row["step_id"], row["request_id"], row["layer"], row["object_id"])
        assert key == (arbitration.step_id, *arbitration.object_key) and row["choice"] == arbitration.choice.value
        options = {o["tag"]: o for o in row["options"]}
        assert not options["exact_load"]["is_feasible"] and options["exact_load"]["predicted_s"] > 0
        assert row["deadline_s"] >= 0 and row["predicted_arrival_s"] >= 0
        assert options[row["choice"]]["is_feasible"] or row["choice"] == "exact_load"
        assert row["predicted_cost"] == pytest.approx(options[row["choice"]]["predicted_cost"])  # the choice's own
        found = re.search(r"late \(([0-9.]+) ms of (disk|host-to-device) link, [0-9.]+ ms left\)", row["late"])
        assert found, row  # the link short of time, as it stood before anything was booked for the object:
        assert float(found[1]) <= 1e3 * options["exact_load"]["predicted_s"] + 1e-3  # one of the load's legs
        assert all(o["is_feasible"] == (o["note"] == "") for o in row["options"]), row["options"]
    kv_rows = [r for r in rows if r["object_kind"] == ObjectKind.KV_BLOCK.value]
    expert_rows = [r for r in rows if r["object_kind"] == ObjectKind.EXPERT.value]
    assert len(kv_rows) + len(expert_rows) == len(rows)
    assert {r["step_id"] for r in kv_rows} & {r["step_id"] for r in expert_rows}  # dual misses: the same steps
    for row in kv_rows:
        options = {o["tag"]: o for o in row["options"]}
        assert row["late"].startswith("exact copy late") and set(options) == {"exact_load", "recompute", "kv_dequant"}
        assert options["kv_dequant"]["note"] == "no quantized copy"  # a swapped-out request keeps full copies
        if Tag.RECOMPUTE.value in allowed:  # a rebuild pays for the experts it loads: with top_k slots, too late
            assert row["choice"] == "exact_load" and "slo slip" in row["reason"]
            assert options["recompute"]["note"] == "past the step's CPU time"
            assert options["recompute"]["predicted_s"] > options["exact_load"]["predicted_s"]
        else:
            assert row["choice"] == "exact_load" and "slo slip" in row["reason"]
            assert options["recompute"]["note"] == "not allowed for the class"
        assert row["measured_arrival_s"] is not None and row["measured_arrival_s"] > 0  # measured by the engine
        assert row["stall_s"] == pytest.approx(max(0.0, row["measured_arrival_s"] - row["deadline_s"]))
        assert row["stall_s"] > 0  # a 50 µs link time: nothing is staged in time on this machine
    for row in expert_rows:
        assert row["late"].startswith("expert load late") and "expert_defer" in {o["tag"] for o in row["options"]}
        assert row["choice"] in ({"expert_defer", "exact_load"} if allowed else {"exact_load"})
        if not allowed:
            assert {o["tag"]: o["note"] for o in row["options"]}["expert_defer"] == "not allowed for the class"
        assert row["choice"] == "expert_defer" or row["reason"].startswith("slo slip")  # budget spent, or none
        if row["choice"] == "expert_defer":  # never fetched in its step: nothing arrived
            assert row["measured_arrival_s"] is None and row["stall_s"] is None
        else:  # loaded: its disk read's end, from the step's start
            assert row["measured_arrival_s"] is not None and row["measured_arrival_s"] > 0
            assert row["stall_s"] == pytest.approx(max(0.0, row["measured_arrival_s"] - row["deadline_s"]))
    assert any(r["measured_arrival_s"] is not None for r in expert_rows)  # some expert loads were measured
    assert any(r["choice"] == "expert_defer" for r in expert_rows) == bool(allowed)
    filled = [r for r in rows if r["audited_cost"] is not None]
    assert filled and all(r["audited_cost"] >= 0 for r in filled)  # the audit measured the steps' KL
    if not allowed:  # exact actions only: the audit's KL is the numeric floor's
        assert max(r["audited_cost"] for r in filled) < 1e-3
    else:  # skipped experts move the output: the audit sees it at some arbitrated step
        assert max(r["audited_cost"] for r in filled) > 1e-3


def test_migration_0008_up_and_down_keeps_runs(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "old.sqlite"
    cfg = alembic_config()
    engine = create_engine(f"sqlite:///{path}")
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0007")
        run = "INSERT INTO runs (started_at, status, controller) VALUES ('2026-12-01', 'complete', 'joint')"
        conn.execute(text(run))
        assert "arbitrations" not in inspect(conn).get_table_names()
        command.upgrade(cfg, "0008")
        assert MigrationContext.configure(conn).get_current_revision() == "0008"
        assert "arbitrations" in inspect(conn).get_table_names()
        assert {i["name"] for i in inspect(conn).get_indexes("arbitrations")} == {"ix_arbitrations_run_step"}
        insert = (
            "INSERT INTO arbitrations (run_id, step_id, request_id, layer, object_kind, object_id, late, options,"
            " choice, reason, predicted_cost, deadline_s, predicted_arrival_s) VALUES (1, 3, 'r', 0, 'kv_block', 2,"
            " 'late', '[]', 'recompute', 'why', 0.0, 0.001, 0.002)"
        )
        conn.execute(text(insert))
        command.downgrade(cfg, "0007")
        assert "arbitrations" not in inspect(conn).get_table_names()
        assert conn.execute(text("SELECT controller FROM runs")).all() == [("joint",)]
        command.upgrade(cfg, "head")
        assert conn.execute(text("SELECT COUNT(*) FROM arbitrations")).scalar_one() == 0
    engine.dispose()

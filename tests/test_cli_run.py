"""`fallbackgate run` end to end on a small random checkpoint: JSON format, ledger, gate."""

from __future__ import annotations

import json
import pathlib
import sqlite3

import pytest

from fallbackgate.cli import main


def test_run_writes_the_documented_json_and_passes_the_gate(tmp_path: pathlib.Path, checkpoint_factory) -> None:
    model = checkpoint_factory("qwen3_moe")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "once upon a time", "id": "a", "max_new_tokens": 5})
        + "\n"
        + json.dumps({"prompt": "the quick brown fox", "id": "b", "class": "chat"})
        + "\n"
    )
    out = tmp_path / "run.json"
    ledger = tmp_path / "ledger.sqlite"
    status = main(["run", "--model", str(model), "--prompts", str(prompts), "--max-new-tokens", "7",
                   "--device-budget-mb", "0.3", "--ledger", str(ledger), "--json", str(out), "--quiet"])
    assert status == 0
    doc = json.loads(out.read_text())
    assert doc["format_version"] == 1 and isinstance(doc["run_id"], int)
    by_id = {r["id"]: r for r in doc["requests"]}
    assert [len(by_id["a"]["output_token_ids"]), len(by_id["b"]["output_token_ids"])] == [5, 7]
    assert by_id["b"]["class"] == "chat"
    for request in doc["requests"]:
        assert set(request) >= {"id", "prompt", "output_token_ids", "text", "ttft_s", "tpot_s", "tags"}
        assert request["ttft_s"] > 0 and request["modeled_ttft_s"] > 0
    per_request = sum(sum(r["tags"].values()) for r in doc["requests"])
    assert sum(t["count"] for t in doc["tags"].values()) >= per_request > 0
    assert doc["tags"]["exact_load"]["bytes"] >= doc["tags"]["exact_load"]["count"] > 0  # budget forced loads
    assert doc["memory"]["device_budget_bytes"] == int(0.3 * 2**20)
    with sqlite3.connect(ledger) as conn:  # the run's verdicts are in the ledger: one per request + the run
        rows = conn.execute("select request_id, passed from verdicts where run_id = ?", (doc["run_id"],)).fetchall()
    assert sorted(rows, key=str) == sorted([("a", 1), ("b", 1), (None, 1)], key=str)


def test_run_refuses_forced_cpu_execute_on_a_cpu(
    tmp_path: pathlib.Path, checkpoint_factory, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where the device is the CPU, RAM is the only fast tier: cpu_execute is not offered (exit 2, the reason)."""
    model = checkpoint_factory("qwen3_moe")
    status = main(["run", "--model", str(model), "--max-new-tokens", "4", "--force", "cpu_execute",
                   "--ledger", str(tmp_path / "l.sqlite"), "--quiet"])
    assert status == 2
    assert "cpu_execute is not offered where the device is the CPU" in capsys.readouterr().err


def test_run_with_a_policy_file_records_its_name_budgets_and_slos(tmp_path: pathlib.Path, checkpoint_factory) -> None:
    from fallbackgate.ledger.dashboard_queries import RunFilter, filter_options, overview_runs
    from fallbackgate.ledger.db import open_ledger
    from fallbackgate.policy import load_policy

    policies = pathlib.Path(__file__).resolve().parents[1] / "fallbackgate" / "policies"
    model = checkpoint_factory("qwen3_moe")
    ledger = tmp_path / "ledger.sqlite"
    status = main(["run", "--policy", str(policies / "two_classes.yaml"), "--model", str(model),
                   "--prompts", str(policies / "two_classes_prompts.jsonl"), "--ledger", str(ledger),
                   "--device-budget-mb", "0.3", "--max-new-tokens", "3", "--quiet"])
    assert status == 0
    with sqlite3.connect(ledger) as conn:
        name, controller, text = conn.execute("select policy_name, controller, policy from runs").fetchone()
        budgets = dict(conn.execute("select request_class, budget from requests").fetchall())
    assert (name, controller) == ("two_classes", "joint")
    recorded = json.loads(text)  # the effective policy: the file with the command-line overrides applied
    shipped = load_policy(policies / "two_classes.yaml")
    assert recorded["classes"].keys() == shipped.classes.keys() and recorded["model"] == str(model)
    assert recorded["memory"]["device_budget_mb"] == 0.3 != shipped.memory.device_budget_mb
    assert json.loads(budgets["strict"])["max_approx_fraction"] == 0
    assert json.loads(budgets["best-effort"])["max_mean_kl"] == 0.05
    with open_ledger(str(ledger)) as opened:
        assert filter_options(opened)["policies"] == ["two_classes"]
        [row] = overview_runs(opened, RunFilter(policies=("two_classes",)))
        assert (row["policy"], row["controller"]) == ("two_classes", "joint")
        assert overview_runs(opened, RunFilter(policies=("joint",))) == []


def test_preemption_happens_from_ordinary_settings_in_both_modes(tmp_path: pathlib.Path) -> None:
    """KV growth at a small device budget preempts running requests by itself (no test hook), swap or
    recompute as asked, and every request still passes the gate."""
    for mode in ("swap", "recompute"):
        out, ledger = tmp_path / f"{mode}.json", tmp_path / f"{mode}.sqlite"
        status = main(["run", "--max-new-tokens", "64", "--device-budget-mb", "0.8", "--max-num-seqs", "6",
                       "--preempt", mode, "--ledger", str(ledger), "--json", str(out), "--quiet"])
        doc = json.loads(out.read_text())
        assert status == 0, mode  # 0: the gate passed (1 would be a failed gate)
        with sqlite3.connect(ledger) as conn:
            verdicts = conn.execute("select passed from verdicts where run_id = ?", (doc["run_id"],)).fetchall()
        assert len(verdicts) == len(doc["requests"]) + 1 and all(passed for (passed,) in verdicts)
        assert sum(r["num_preemptions"] for r in doc["requests"]) > 0, mode
        tags = doc["tags"]
        assert tags["recompute" if mode == "recompute" else "exact_load"]["count"] > 0

"""Policy files: the shipped examples load, and 30+ malformed files are each rejected naming the field."""

from __future__ import annotations

import argparse
import json
import pathlib

import pytest

from fallbackgate.cli import main
from fallbackgate.policy import Policy, PolicyError, hardware_profile, json_schema, load_policy, loads_policy
from fallbackgate.policy.apply import merge_args, policy_record

POLICIES = pathlib.Path(__file__).resolve().parents[1] / "fallbackgate" / "policies"
GOOD_CLASS = "classes: {c: {budget: {max_mean_kl: 0.1, max_p99_kl: 0.2, allowed_tags: [kv_dequant]}}}\n"

# (policy text, field path the error must name, a fragment of what was expected)
MALFORMED: list[tuple[str, str, str]] = [
    ("version: 2", "version", "1"),
    ("bogus: 1", "bogus", "unknown keys"),
    ("model: [1, 2]", "model", "string"),
    ("hardware: {profile: tpu-pod}", "hardware.profile", "cpu-box"),
    ("hardware: {host_to_device_bytes_per_s: 0}", "hardware.host_to_device_bytes_per_s", "> 0"),
    ("hardware: {device_flops: -5}", "hardware.device_flops", "> 0"),
    ("hardware: {link_latency_s: -1}", "hardware.link_latency_s", ">= 0"),
    ("hardware: {pcie: 1}", "hardware.pcie", "unknown keys"),
    ("hardware: fast", "hardware", "dictionary"),
    ("memory: {device_budget_mb: 0}", "memory.device_budget_mb", "> 0"),
    ("memory: {device_budget_mb: lots}", "memory.device_budget_mb", "number"),
    ("memory: {host_budget_mb: -1}", "memory.host_budget_mb", "> 0"),
    ("memory: {block_size: 12}", "memory.block_size", "power of two"),
    ("memory: {block_size: 0}", "memory.block_size", ">= 1"),
    ("memory: {max_num_seqs: 0}", "memory.max_num_seqs", ">= 1"),
    ("memory: {preempt_mode: drop}", "memory.preempt_mode", "swap"),
    ("memory: {spill_dir: [a]}", "memory.spill_dir", "string"),
    ("controller: {kind: greedy}", "controller.kind", "joint"),
    ("controller: {expert_fraction: 1.0}", "controller.expert_fraction", "< 1"),
    ("controller: {routing_decay: 0}", "controller.routing_decay", "> 0"),
    ("controller: {kv_quant_bits: 2}", "controller.kv_quant_bits", "8"),
    ("controller: {expert_lowbit_bits: 16}", "controller.expert_lowbit_bits", "4"),
    ("controller: {kind: joint, knob: 1}", "controller.knob", "unknown keys"),
    ("audit: {mode: shadow}", "audit.mode", "observe"),
    ("audit: {sample_rate: 0}", "audit.sample_rate", "> 0"),
    ("audit: {sample_rate: 1.5}", "audit.sample_rate", "<= 1"),
    ("ledger: {url: ''}", "ledger.url", "at least 1"),
    ("ledger: sqlite.db", "ledger", "dictionary"),
    ("classes: {}", "classes", "at least 1"),
    ("classes: {'9lives': {}}", "classes", "class names"),
    ("classes: {c: {slo: {tpot_ms: 0}}}", "classes.c.slo.tpot_ms", "> 0"),
    ("classes: {c: {slo: {ttft_ms: -3}}}", "classes.c.slo.ttft_ms", "> 0"),
    ("classes: {c: {slo: {tpot_ms: 50, p99_tpot_ms: 10}}}", "classes.c.slo.p99_tpot_ms", ">= tpot_ms"),
    ("classes: {c: {slo: {ttft_ms: 500, p99_ttft_ms: 100}}}", "classes.c.slo.p99_ttft_ms", ">= ttft_ms"),
    ("classes: {c: {slo: {tbt_ms: 5}}}", "classes.c.slo.tbt_ms", "unknown keys"),
    ("classes: {c: {budget: {max_mean_kl: -0.1}}}", "classes.c.budget.max_mean_kl", ">= 0"),
    ("classes: {c: {budget: {max_mean_kl: 0.5, max_p99_kl: 0.1}}}", "classes.c.budget.max_p99_kl", ">= max_mean_kl"),
    ("classes: {c: {budget: {min_top1_agreement: 1.2}}}", "classes.c.budget.min_top1_agreement", "<= 1"),
    ("classes: {c: {budget: {max_approx_fraction: -0.1}}}", "classes.c.budget.max_approx_fraction", ">= 0"),
    ("classes: {c: {budget: {allowed_tags: [skip_layer]}}}", "classes.c.budget.allowed_tags[0]", "expert_defer"),
    ("classes: {c: {budget: {allowed_tags: [kv_dequant, kv_dequant]}}}", "classes.c.budget.allowed_tags", "repeats"),
    ("classes: {c: {budget: {allowed_tags: kv_dequant}}}", "classes.c.budget.allowed_tags", "list"),
    ("classes: {c: {budget: {max_kl: 1}}}", "classes.c.budget.max_kl", "unknown keys"),
    ("classes: {c: {sla: {}}}", "classes.c.sla", "unknown keys"),
    (GOOD_CLASS + "default_class: d", "default_class", "class names"),
    ("classes: {c: {budget: {max_mean_kl: abc}}}", "classes.c.budget.max_mean_kl", "number"),
]


def test_shipped_policies_load() -> None:
    names = sorted(p.stem for p in POLICIES.glob("*.yaml"))
    assert names == ["aggressive", "balanced", "demo", "exact", "two_classes"]
    two = load_policy(POLICIES / "two_classes.yaml")
    assert set(two.classes) == {"strict", "best-effort"}
    assert two.classes["strict"].budget.allowed_tags == ["recompute"]  # cpu_execute: GPU machines only
    assert "expert_defer" in two.classes["best-effort"].budget.allowed_tags
    assert load_policy(POLICIES / "exact.yaml").controller.kind == "exact_lru"
    assert load_policy(POLICIES / "balanced.yaml").audit.mode == "observe"
    assert load_policy(POLICIES / "demo.yaml").audit.mode == "enforce"  # the default run's demo


def test_every_shipped_policy_file_passes_policy_check(capsys) -> None:
    from fallbackgate.cli import main

    files = sorted(POLICIES.glob("*.yaml")) + sorted((POLICIES.parents[1] / "evals" / "policies").glob("*.yaml"))
    assert len(files) == 6
    for path in files:
        assert main(["policy", "check", str(path)]) == 0, capsys.readouterr().err
    parity = load_policy(POLICIES.parents[1] / "evals" / "policies" / "ci_kv_int4.yaml").parity
    assert parity is not None and parity.default.min_agreement == 0.75  # one schema: the parity section included
    assert parity.for_task("fg_rolling_ppl").min_agreement == 0.0


def test_enough_malformed_cases() -> None:
    assert len(MALFORMED) >= 30
    assert len({text for text, _, _ in MALFORMED}) == len(MALFORMED)


@pytest.mark.parametrize(("text", "field", "expected"), MALFORMED, ids=[f for _, f, _ in MALFORMED])
def test_malformed_policy_names_the_field(text: str, field: str, expected: str, tmp_path: pathlib.Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    lines = info.value.messages
    match = [m for m in lines if m.startswith(field + ":")]
    assert match, f"no message names {field!r}: {lines}"
    assert "got " in match[0] and expected in match[0], match[0]
    assert str(path) in str(info.value)


def test_value_is_quoted_in_the_message() -> None:
    with pytest.raises(PolicyError) as info:
        loads_policy("memory: {block_size: 12}")
    assert info.value.messages == ["memory.block_size: got 12; expected a power of two"]


def test_several_errors_are_all_reported() -> None:
    with pytest.raises(PolicyError) as info:
        loads_policy("audit: {mode: x, sample_rate: 2}\nextra: 1")
    fields = sorted(m.split(":")[0] for m in info.value.messages)
    assert fields == ["audit.mode", "audit.sample_rate", "extra"]


@pytest.mark.parametrize(("text", "where"), [("a: [1, 2", "line 1"), ("- 1\n- 2", "(top level)"), ("7", "(top level)")])
def test_not_a_policy_document(text: str, where: str) -> None:
    with pytest.raises(PolicyError) as info:
        loads_policy(text)
    assert info.value.messages[0].startswith(where)


def test_missing_file() -> None:
    with pytest.raises(PolicyError, match="does not exist"):
        load_policy("/nonexistent/policy.yaml")


def test_empty_file_gives_defaults() -> None:
    policy = loads_policy("")
    assert policy.controller.kind == "joint" and policy.audit.mode == "observe"
    assert policy.classes["default"].budget.allowed_tags == []


def test_hardware_overrides_apply() -> None:
    policy = loads_policy("hardware: {profile: pcie4-gpu-nvme, host_to_device_bytes_per_s: 1.0e9}")
    profile = hardware_profile(policy)
    assert profile.host_to_device_bytes_per_s == 1e9 and profile.device_flops == 150e12


def test_json_schema_forbids_unknown_keys() -> None:
    schema = json_schema()
    assert schema["additionalProperties"] is False
    assert schema["$defs"]["QualityBudget"]["additionalProperties"] is False
    budget = schema["$defs"]["QualityBudget"]["properties"]
    assert {"max_mean_kl", "max_p99_kl", "min_top1_agreement", "max_approx_fraction", "allowed_tags"} <= set(budget)
    json.dumps(schema)


def test_cli_schema_and_check(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "schema.json"
    assert main(["policy", "schema", "--output", str(out)]) == 0
    assert json.loads(out.read_text())["title"] == "fallbackgate policy"
    assert main(["policy", "check", str(POLICIES / "two_classes.yaml")]) == 0
    assert "class best-effort" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("classes: {c: {budget: {max_mean_kl: -1}}}")
    assert main(["policy", "check", str(bad)]) == 2
    assert "classes.c.budget.max_mean_kl: got -1" in capsys.readouterr().err


def test_command_line_overrides_policy() -> None:
    policy = load_policy(POLICIES / "balanced.yaml")
    args = argparse.Namespace(device_budget_mb=3.0, mode="enforce", controller=None, audit_rate=None, model=None)
    merged = merge_args(policy, args)
    assert merged.memory.device_budget_mb == 3.0 and merged.audit.mode == "enforce"
    assert merged.controller.kind == "joint" and merged.audit.sample_rate == policy.audit.sample_rate
    assert isinstance(merged, Policy)


def test_recorded_policy_hides_the_ledger_password() -> None:
    policy = load_policy(POLICIES / "balanced.yaml")
    args = argparse.Namespace(ledger="postgresql+psycopg://fg:s3cret@db.example/ledger", model=None)
    recorded = json.loads(policy_record(merge_args(policy, args)))
    assert recorded["ledger"]["url"] == "postgresql+psycopg://fg:***@db.example/ledger"
    assert "s3cret" not in policy_record(merge_args(policy, args))
    assert recorded["classes"]["default"]["budget"]["max_mean_kl"] == policy.classes["default"].budget.max_mean_kl

"""One assembly: the same policy file built through ``run``, ``serve``, lm-eval and ``sweep`` gives the same
engine configuration and controller settings; without a policy file, ``run`` and ``serve`` build
``Policy()`` with the documented overrides (exact-only LRU, enforce mode)."""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
from collections.abc import Iterator

import pytest

import fallbackgate
from fallbackgate.assembly import Assembly, assemble, no_policy
from fallbackgate.commands import run as run_command
from fallbackgate.commands import serve as serve_command
from fallbackgate.commands import sweep as sweep_command
from fallbackgate.controllers import ExactLRUController, JointController
from fallbackgate.engine.config import MIB
from fallbackgate.evals.engine_setup import build_setup
from fallbackgate.policy import load_policy
from fallbackgate.sweep.grid import SweepConfig
from fallbackgate.tinymoe import CHECKPOINT_DIR

BALANCED = pathlib.Path(fallbackgate.__file__).parent / "policies" / "balanced.yaml"


def _args(command: str, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers()
    {"run": run_command, "serve": serve_command}[command].add_parser(subparsers)
    return parser.parse_args([command, *argv])


def _run(argv: list[str]) -> Assembly:
    policy, overrides, name = run_command.run_inputs(_args("run", argv))
    return assemble(policy, overrides, policy_name=name)


def _serve(argv: list[str]) -> Assembly:
    built, writer, _ = serve_command._setup(_args("serve", ["--no-ledger", *argv]))
    assert writer is None
    return built


@pytest.fixture
def closing() -> Iterator[list[Assembly]]:
    built: list[Assembly] = []
    yield built
    for one in built:
        one.engine.close()


def _engine_fields(built: Assembly) -> dict:
    assert built.engine.config is built.engine_config
    return dataclasses.asdict(built.engine_config)


def test_one_policy_file_assembles_the_same_through_every_command(closing: list[Assembly]) -> None:
    policy = load_policy(BALANCED)
    assert policy.memory.device_budget_mb and policy.controller.kind == "joint"
    run = _run(["--policy", str(BALANCED)])
    serve = _serve(["--policy", str(BALANCED)])
    lm_eval = build_setup(policy=BALANCED, chunk_tokens=256).assembly  # run's tokens per forward
    cfg = SweepConfig(model_dir=str(CHECKPOINT_DIR), policy=policy, is_equivalent_allowed=False)
    budget = int(policy.memory.device_budget_mb * MIB)
    sweep = sweep_command.cell_builder(cfg)("joint", budget, policy.controller.expert_fraction, None)
    closing += [run, serve, lm_eval, sweep]

    want = _engine_fields(run)
    assert want["device_budget_bytes"] == budget and want["is_observe"]
    assert _engine_fields(serve) == want
    assert _engine_fields(lm_eval) == want
    assert _engine_fields(sweep) == want | {"is_observe": False}  # every sweep cell is an enforce run
    for built in (serve, lm_eval, sweep):
        assert built.controller_settings == run.controller_settings
    assert run.controller_settings.top_k == int(run.engine.model_config.num_experts_per_tok)
    for built in (run, serve, lm_eval):
        assert type(built.controller) is JointController
        assert built.controller.top_k == run.controller_settings.top_k  # given at construction
    assert type(sweep.controller.inner) is JointController  # inside the sweep's trace recorder
    assert run.classes == serve.classes == sweep.classes
    assert run.classes.budgets == {"default": policy.classes["default"].budget.as_gate_dict()}


def test_without_a_policy_file_run_is_the_default_policy_with_its_overrides(
    tmp_path: pathlib.Path, closing: list[Assembly]
) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("version: 1\n")  # Policy() itself
    bare = _run([])
    default = _run(["--policy", str(empty), "--controller", "exact_lru", "--mode", "enforce"])
    closing += [bare, default]
    assert _engine_fields(bare) == _engine_fields(default)
    assert bare.controller_settings == default.controller_settings
    assert bare.policy == no_policy() and bare.policy_name is None
    fields = _engine_fields(bare)
    assert (fields["block_size"], fields["max_num_seqs"], fields["preempt_mode"]) == (16, 8, "swap")
    assert not fields["is_observe"] and bare.audit_rate == 1.0
    assert type(bare.controller) is ExactLRUController
    assert (bare.classes.budgets, bare.classes.slos) == ({}, {})  # no declared classes: nothing judged by budget


def test_without_a_policy_file_forced_tags_reach_the_exact_lru_controller(closing: list[Assembly]) -> None:
    forced = _run(["--force", "expert_defer"])
    closing.append(forced)
    assert forced.controller_settings.force == ("expert_defer",)
    assert {t.value for t in forced.controller.force} == {"expert_defer"}
    assert not forced.engine_config.is_stacked_when_fits  # forced tags act on misses, which stacking removes


def test_serve_without_a_policy_file_audits_a_tenth(closing: list[Assembly]) -> None:
    served = _serve([])
    closing.append(served)
    assert served.audit_rate == 0.1 and type(served.controller) is ExactLRUController
    assert not served.engine_config.is_observe

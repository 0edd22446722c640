"""``fallbackgate sweep --ram-basis-from`` and ``--max-num-seqs``: RAM budgets as fractions of another sweep's
demand (the same bytes for a smaller copy of its model), and how many requests decode together, each reaching
the cells and the policy, refused with a clear error where they cannot hold."""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

import pytest

from fallbackgate.commands import sweep as sweep_command
from fallbackgate.sweep.inputs import earlier_references, read_ram_basis
from fallbackgate.sweep.merge import MergeError, merge
from fallbackgate.sweep.regime import RegimeConfig, grid
from fallbackgate.sweep.workload import default_policy
from tests.test_sweep_merge import CONFIG, _sweep


def _earlier(tmp_path: pathlib.Path, demands: dict[tuple[str, int], int]) -> pathlib.Path:
    points = [{"workload": w, "seed": s, "demand_bytes": d, "controller": c}
              for (w, s), d in demands.items() for c in ("joint", "independent_lru")]  # fmt: skip
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"points": points}))
    return path


def test_budgets_are_fractions_of_the_other_sweeps_demand_per_workload_and_seed(tmp_path: pathlib.Path) -> None:
    earlier = _earlier(tmp_path, {("mixed", 0): 24_000, ("mixed", 1): 20_000, ("short-chat", 0): 9_000})
    cfg = RegimeConfig(model_dir="m", workloads=("mixed",), seeds=(0, 1), ram_fracs=(0.25, 0.5),
                       controllers=("joint",))  # fmt: skip
    basis = read_ram_basis(cfg, earlier)
    assert basis == {"mixed/0": 24_000, "mixed/1": 20_000}
    cells = grid(dataclasses.replace(cfg, ram_basis=basis, ram_fracs=(0.25, 0.5, 0.75)), "mixed", 1, 12_000)
    assert [(c["ram_bytes"], c["demand_bytes"], c["ram_basis_bytes"], c["is_binding"]) for c in cells] == [
        (5_000, 12_000, 20_000, True), (10_000, 12_000, 20_000, True), (15_000, 12_000, 20_000, False)]  # fmt: skip
    own = grid(cfg, "mixed", 1, 12_000)
    assert [c["ram_bytes"] for c in own] == [3_000, 6_000] and "ram_basis_bytes" not in own[0]


def test_a_basis_without_this_sweeps_seed_or_not_a_sweep_is_refused(tmp_path: pathlib.Path) -> None:
    cfg = RegimeConfig(model_dir="m", workloads=("mixed",), seeds=(0, 5))
    with pytest.raises(ValueError, match="no run of mixed/5"):
        read_ram_basis(cfg, _earlier(tmp_path, {("mixed", 0): 24_000}))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a sweep.json with points"):
        read_ram_basis(cfg, tmp_path / "bad.json")
    with pytest.raises(ValueError, match="--ram-basis-from"):
        read_ram_basis(cfg, tmp_path / "missing.json")


def test_max_num_seqs_reaches_the_policy_and_must_match_an_earlier_parts_targets(tmp_path: pathlib.Path) -> None:
    assert default_policy(max_num_seqs=16).memory.max_num_seqs == 16
    assert default_policy().memory.max_num_seqs == 8
    cfg = RegimeConfig(**{k: v for k, v in CONFIG.items() if k != "controllers"}, controllers=("joint",),
                       max_num_seqs=16)  # fmt: skip
    earlier = tmp_path / "sweep.json"
    earlier.write_text(json.dumps({"config": CONFIG, "slo_references": {"short-chat": {}}}))  # written before: 8
    with pytest.raises(ValueError, match="its max_num_seqs is 8, this one's 16"):
        earlier_references(cfg, earlier)
    earlier.write_text(json.dumps({"config": CONFIG | {"max_num_seqs": 16}, "slo_references": {"short-chat": {}}}))
    assert earlier_references(cfg, earlier) == {"short-chat": {}}


def test_the_flags_build_the_config_and_bad_values_are_refused(tmp_path: pathlib.Path) -> None:
    parser = argparse.ArgumentParser()
    sweep_command.add_parser(parser.add_subparsers())
    earlier = _earlier(tmp_path, {("mixed", 3): 10_000})
    args = parser.parse_args(["sweep", "--workloads", "mixed", "--seeds", "3", "--max-num-seqs", "16",
                              "--ram-basis-from", str(earlier), "--out", str(tmp_path / "o")])  # fmt: skip
    cfg = sweep_command.config_from_args(args)
    assert cfg.max_num_seqs == 16 and cfg.ram_basis == {"mixed/3": 10_000}
    args = parser.parse_args(["sweep", "--max-num-seqs", "0", "--out", str(tmp_path / "o")])
    with pytest.raises(ValueError, match="--max-num-seqs"):
        sweep_command.config_from_args(args)


def test_parts_with_and_without_a_basis_do_not_merge_and_bases_pool() -> None:
    a = _sweep([0, 1], 8.0, ram_basis={"short-chat/0": 40, "short-chat/1": 40})
    b = _sweep([3], 8.0, ram_basis={"short-chat/3": 44})
    assert merge([a, b], ["a", "b"])["config"]["ram_basis"] == {"short-chat/0": 40, "short-chat/1": 40,
                                                                "short-chat/3": 44}  # fmt: skip
    with pytest.raises(MergeError, match="ram-basis-from"):
        merge([a, _sweep([3], 8.0)], ["a", "b"])
    with pytest.raises(MergeError, match="'max_num_seqs' is 16, not 8"):
        merge([_sweep([0], 8.0), _sweep([3], 8.0, max_num_seqs=16)], ["a", "b"])

"""bench.joint_ab: joint in sweep B against sweep A, paired by workload, budget and seed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fallbackgate.bench.joint_ab import compare_lines, joint_points, main


def _sweep(path: Path, p99_by_seed: dict[int, float], lowbit: float = 0.0) -> str:
    points = [{"workload": "mixed", "ram_frac": 0.5, "seed": s, "controller": c,
               "metrics": {"tpot_p99_ms": v if c == "joint" else 99.0, "bytes_expert_exact_load": 100.0,
                           "bytes_expert_resident": 7.0, "bytes_expert_expert_lowbit": lowbit,
                           "belady_expert_bytes_same_room": 50.0}}
              for s, v in p99_by_seed.items() for c in ("joint", "static_split")]  # fmt: skip
    path.write_text(json.dumps({"points": points}))
    return str(path)


def test_paired_difference_in_percent_of_a_with_a_t_interval(tmp_path: Path) -> None:
    a = joint_points(_sweep(tmp_path / "a.json", {0: 10.0, 1: 20.0, 2: 30.0}))
    b = joint_points(_sweep(tmp_path / "b.json", {0: 11.0, 1: 23.0, 2: 32.0, 3: 5.0}, lowbit=25.0))
    assert len(a) == 3  # joint's runs only
    lines = compare_lines(a, b, ("tpot_p99_ms", "over_belady_same_room", "io_write_bytes"))
    assert lines[0] == "mixed@0.5 n=3"  # seed 3 has no partner in A
    # differences 1, 3, 2: mean 2 = 10 % of A's mean 20; half-width t(0.975, 2) * 1 / sqrt(3) = 2.484 -> 12.4 %
    assert lines[1].split() == ["tpot_p99_ms", "20", "->", "22", "(+10.0%", "[-2.4,", "+22.4])"]
    # exact + low-bit bytes (resident ones left out) over Belady: 100/50 -> 125/50
    assert lines[2].split()[:4] == ["over_belady_same_room", "2", "->", "2.5"]
    assert "(+25.0% [+25.0, +25.0])" in lines[2]
    assert lines[3].endswith("0 -> 0 (n/a: A's mean is 0)")  # a measure no run recorded counts 0


def test_the_command_prints_the_cells(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _sweep(tmp_path / "a.json", {0: 10.0, 1: 20.0})
    main([a, a, "--metrics", "tpot_p99_ms"])
    assert capsys.readouterr().out.splitlines()[1].endswith("(+0.0% [+0.0, +0.0])")


def test_a_control_pairs_a_baselines_runs_instead(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def lru(path: Path, p99: float) -> str:
        points = [{"workload": "mixed", "ram_frac": 0.5, "seed": s, "controller": c,
                   "metrics": {"tpot_p99_ms": p99 if c == "independent_lru" else 1.0}}
                  for s in (0, 1) for c in ("independent_lru", "joint")]  # fmt: skip
        path.write_text(json.dumps({"points": points}))
        return str(path)

    main([lru(tmp_path / "a.json", 10.0), lru(tmp_path / "b.json", 11.0), "--metrics", "tpot_p99_ms",
          "--controller", "independent_lru"])  # fmt: skip
    assert capsys.readouterr().out.splitlines()[1].split()[1:4] == ["10", "->", "11"]

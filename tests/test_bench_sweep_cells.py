"""``python -m fallbackgate.bench.sweep_cells``: named cells, their per-cell numbers and joint's ratios; and
(slow, root with cgroup v1 only) the quick run on a one-layer OLMoE-shaped checkpoint inside a memory cgroup."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import pytest

from fallbackgate.bench import sweep_cells
from fallbackgate.bench.scale import CGROUP_ROOT
from fallbackgate.bench.sweep_cells import DEFAULT_CELLS, NamedCell, comparisons, parse_cell
from fallbackgate.synth.__main__ import main as synth

GIB = 1 << 30


def test_cells_parse_by_name_and_bad_names_say_what_is_wrong() -> None:
    assert parse_cell("mixed/static_split/kv0.3") == NamedCell("mixed", "static_split", 0.3)
    assert parse_cell("long-retrieval/joint") == NamedCell("long-retrieval", "joint", None)
    assert [parse_cell(c).name for c in DEFAULT_CELLS] == list(DEFAULT_CELLS)
    for bad, says in (("mixed/joint/kv0.3", "the others none"), ("mixed/static_split", "needs a KV share"),
                      ("chat/joint", "expected WORKLOAD"), ("mixed/static_split/kvX", "is not kv"),
                      ("mixed/static_split/kv1.5", r"in \(0, 1\)")):  # fmt: skip
        with pytest.raises(ValueError, match=says):
            parse_cell(bad)


def test_bad_flags_exit_2_before_anything_runs(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        sweep_cells.parse_args(["--model", "x", "--max-new-tokens", "65"])
    assert exc.value.code == 2 and "must be in [1, 64]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sweep_cells.parse_args(["--model", "x", "--ram-budget-mb", "8192", "--cgroup-mb", "4096"])
    assert "below --cgroup-mb" in capsys.readouterr().err


def _cell(tpot: float, read: float, tokens: float, slo: float) -> dict:
    return {"summary": {"tpot_p99_ms": tpot, "ttft_p99_ms": 2 * tpot, "read_gib": read, "tokens_per_s": tokens,
                        "slo_attainment": slo}}  # fmt: skip


def test_joint_is_compared_with_two_lrus_and_the_static_split_with_the_best_p99() -> None:
    cells = {
        "mixed/static_split/kv0.1": _cell(400.0, 10.0, 2.0, 0.0),
        "mixed/static_split/kv0.3": _cell(300.0, 12.0, 2.5, 0.5),
        "mixed/independent_lru": _cell(500.0, 16.0, 1.5, 0.0),
        "mixed/joint": _cell(240.0, 8.0, 3.0, 1.0),
        "long-retrieval/joint": _cell(1.0, 1.0, 1.0, 1.0),
    }
    out = comparisons(cells, "mixed")
    assert out["joint_over_independent_lru"]["tpot_p99"] == pytest.approx(0.48)
    assert out["joint_over_independent_lru"]["read_bytes"] == pytest.approx(0.5)
    best = out["joint_over_best_static_by_tpot_p99"]  # kv0.3: the lower P99
    assert best["tpot_p99"] == pytest.approx(0.8) and best["read_bytes"] == pytest.approx(8 / 12)
    assert best["tokens_per_s"] == pytest.approx(1.2) and best["slo_attainment"] == [1.0, 0.5]
    assert comparisons(cells, "long-retrieval") == {}  # nothing to compare joint with
    assert comparisons({k: v for k, v in cells.items() if "joint" not in k}, "mixed") == {}


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not CGROUP_ROOT.is_dir(), reason="needs root and cgroup v1 memory")
def test_quick_cells_run_inside_the_cap_with_tagged_bytes_equal_to_the_kernel_s(tmp_path: pathlib.Path) -> None:
    model = tmp_path / "olmoe-1"
    assert synth(["--like", "olmoe-1b-7b", "--num-layers", "1", "--out", str(model)]) == 0
    out = tmp_path / "cells.json"
    assert sweep_cells.main(["--model", str(model), "--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["cells"]) == {"long-retrieval/independent_lru", "long-retrieval/joint"}
    for point in result["cells"].values():
        s, m = point["summary"], point["metrics"]
        assert point["exit_status"] == 0 and point["cgroup_peak_bytes"] <= result["cgroup_bytes"]
        assert s["gate_passed"] == 1.0 and m["output_tokens"] > 0 and s["expert_miss_rate"] > 0.5
        assert 0.9 <= s["kernel_over_io_read"] <= 1.1  # what the run says it read is what the kernel read
        assert max(m["peak_pool_by_kind"].values()) <= result["ram_budget_bytes"]
        assert s["peak_kv_pool_gib"] * GIB == m["peak_pool_by_kind"]["kv_block"] > 0
        assert 0 < m["peak_rss_serve_bytes"] <= point["peak_rss_bytes"]  # this cell's serving, then its audit
    assert "joint_over_independent_lru" in result["comparisons"]["long-retrieval"]


def test_the_table_has_one_row_per_cell_and_says_which_failed() -> None:
    full = {"tokens_per_s": 2.5, "ttft_p50_ms": 1500.0, "ttft_p99_ms": 2500.0, "tpot_p50_ms": 300.0,
            "tpot_p99_ms": 900.0, "slo_attainment": 0.5, "expert_miss_rate": 0.6, "kv_miss_rate": 0.01,
            "read_gib": 12.25, "kernel_over_io_read": 0.999, "io_write_gib": 0.25, "stall_expert_s": 30.0,
            "stall_kv_s": 0.5, "expert_read_over_belady_same_room": 1.4, "read_over_foo": 1.5, "mean_kl": 2e-6,
            "cgroup_peak_gib": 7.5}  # fmt: skip
    table = sweep_cells.markdown_table({"mixed/joint": {"summary": full}, "mixed/independent_lru": {"exit_status": -9}})
    head, rule, joint, failed = table.splitlines()
    assert head.count("|") == rule.count("|") == joint.count("|") == failed.count("|") == 14
    assert "| mixed/joint | 2.50 | 1.5 / 2.5 | 300 / 900 | 0.50 | 0.60 / 0.010 | 12.25 (0.999) | 0.25 |" in joint
    assert "| 1.40 | 1.50 | 2.0e-06 | 7.50 |" in joint and "| mixed/independent_lru | exit -9 |" in failed
    unknown = {**full, "kernel_over_io_read": None, "read_over_foo": None}  # nothing read: no ratio, not 0
    row = sweep_cells.markdown_table({"mixed/joint": {"summary": unknown}}).splitlines()[2]
    assert "12.25 (—)" in row and "| 1.40 | — |" in row


def test_references_are_reused_only_from_a_run_of_the_same_requests(tmp_path: pathlib.Path, capsys) -> None:
    args = sweep_cells.parse_args(["--model", "m", "--cells", "mixed/joint"])
    config = dataclasses.asdict(sweep_cells.regime_config(args))
    earlier = tmp_path / "earlier.json"
    refs = {"mixed": {"exit_status": 0, "demand_bytes": 9}, "long-retrieval": {"exit_status": -9}}
    earlier.write_text(json.dumps({"config": config, "references": refs}))
    assert sweep_cells.reused_references(str(earlier), config) == {"mixed": refs["mixed"]}  # failed ones rerun
    earlier.write_text(json.dumps({"config": {**config, "max_new_tokens": 64}, "references": refs}))
    with pytest.raises(ValueError, match="max_new_tokens differ"):
        sweep_cells.reused_references(str(earlier), config)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    missing = ["--model", str(tmp_path / "m"), "--references", str(tmp_path / "none.json")]
    if os.geteuid() == 0 and CGROUP_ROOT.is_dir():  # the cgroup check comes first elsewhere
        assert sweep_cells.main(missing) == 2 and "none.json" in capsys.readouterr().err

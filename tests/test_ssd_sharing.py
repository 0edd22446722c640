"""``python -m fallbackgate.bench.ssd_sharing``: a trace's transfers performed under each way for experts and KV
to share one disk (queue order × one queue or one per kind), ratios against the engine's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fallbackgate.bench import ssd_sharing
from fallbackgate.tracing.devices import fit_waits
from fallbackgate.tracing.reader import read_trace
from fallbackgate.tracing.realio import RealIO, simulate_real
from fallbackgate.tracing.simulate import SimulationConfig
from fallbackgate.tracing.simulate_input import load_input
from fallbackgate.tracing.synthetic import Planted, write_planted_trace
from fallbackgate.tracing.validate import recorded_budget

KIB = 1024
PLANTED = Planted(num_steps_per_phase=10, num_layers=3, num_experts=16, bytes_per_expert=32 * KIB,
                  bytes_per_kv_block=8 * KIB, total_budget_bytes=1 << 20)  # fmt: skip


def _trace_and_scratch(tmp_path: Path) -> tuple[Path, Path]:
    """A small planted trace and an empty scratch directory under `tmp_path`."""
    trace, scratch = tmp_path / "trace", tmp_path / "scratch"
    write_planted_trace(trace, PLANTED)
    scratch.mkdir()
    return trace, scratch


def test_every_layout_runs_every_cell_against_the_engines_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace, scratch = _trace_and_scratch(tmp_path)
    out = tmp_path / "r.json"
    argv = ["--trace", str(trace), "--dir", str(scratch), "--no-pace", "--repeats", "2", "--json", str(out)]
    assert ssd_sharing.main([*argv, "--png", str(tmp_path / "r.png")]) == 0
    result = json.loads(out.read_text())
    assert [(c["controller"], c["repeat"]) for c in result["cells"]] == [
        ("joint", 0), ("joint", 1), ("static_split", 0), ("static_split", 1)
    ]  # fmt: skip
    for cell in result["cells"]:
        names = ["priority/shared", "fifo/shared", "priority/by_kind", "fifo/by_kind", "priority/shared/1"]
        assert list(cell["layouts"]) == names
        assert [cell["layouts"][n]["io_workers"] for n in names] == [2, 2, 2, 2, 1]  # the control: one worker
        assert cell["layouts"]["priority/shared"]["stall_ratio"] == 1.0
        moved = [layout["bytes_moved"] for layout in cell["layouts"].values()]
        assert all(m == moved[0] for m in moved)  # the same decisions, so the same transfers, in every layout
    summary = result["summary"]
    assert summary["priority/shared"]["stall_ratio_mean"] == 1.0 and summary["fifo/by_kind"]["num_cells"] == 4
    assert 0.0 < result["kv_share_of_bytes"] < 1.0 and (tmp_path / "r.png").stat().st_size > 0
    assert set(result["kv_share_of_bytes_by_controller"]) == {"joint", "static_split"}
    assert (result["kv_bytes_scale"], result["budget_scale"]) == (1.0, 1.0)
    assert list(scratch.iterdir()) == []  # every scratch file removed
    over = summary["fifo/shared"]["by_controller"]["joint"]["stall_ratio"]  # one trace: a mean, no spread
    assert over["n"] == 1 and over["lo"] == over["mean"] == over["hi"]
    again = tmp_path / "again.json"
    assert ssd_sharing.main(["--summarize", str(out), "--json", str(again), "--trace", "-", "--dir", "-"]) == 0
    assert json.loads(again.read_text())["summary"] == summary  # summarized again from the cells alone
    assert ssd_sharing.main(["--summarize", str(out), "--kv-scale", "4", "--trace", "-", "--dir", "-"]) == 2
    assert "--summarize runs nothing" in capsys.readouterr().err


def test_bad_input_is_refused_with_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert ssd_sharing.main(["--trace", str(tmp_path), "--dir", str(tmp_path / "nowhere")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_layouts_can_be_chosen_and_the_reference_always_runs(tmp_path: Path) -> None:
    assert ssd_sharing.chosen_layouts("priority/shared/1") == [("priority", "shared"), ("priority", "shared/1")]
    with pytest.raises(ValueError, match="--layouts: unknown lifo/shared"):
        ssd_sharing.chosen_layouts("lifo/shared")


def test_a_larger_kv_moves_a_larger_share_of_the_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    trace, scratch = _trace_and_scratch(tmp_path)
    shares = {}
    base = ["--trace", str(trace), "--dir", str(scratch), "--no-pace", "--controllers", "static_split",
            "--layouts", "priority/shared"]  # fmt: skip
    performed = []
    real = ssd_sharing.simulate_real
    monkeypatch.setattr(ssd_sharing, "simulate_real", lambda *a, **k: performed.append(a) or real(*a, **k))
    assert ssd_sharing.main([*base, "--kv-scale", "4"]) == 2  # at the recorded budget a layer's K/V cannot fit
    assert "layer gathers did not fit the budget at --kv-scale 4" in capsys.readouterr().err
    assert performed == []  # refused from the modelled pass, before any real run
    assert ssd_sharing.main([*base, "--workers", "3", "--layouts", "priority/by_kind"]) == 2  # half per kind
    assert "even --io-workers" in capsys.readouterr().err and performed == []
    for scale in (1.0, 2.0):
        out = tmp_path / f"r{scale:g}.json"
        assert ssd_sharing.main([*base, "--kv-scale", f"{scale:g}", "--budget-scale", "2", "--json", str(out)]) == 0
        result = json.loads(out.read_text())
        assert (result["kv_bytes_scale"], result["budget_scale"]) == (scale, 2.0)
        assert result["cells"][0]["layouts"]["priority/shared"]["num_unfit_gathers"] == 0
        (cell,) = result["cells"]
        writes = cell["layouts"]["priority/shared"]["bytes_moved"].get("kv_block:write", 0)
        assert writes % round(PLANTED.bytes_per_kv_block * scale) == 0  # whole blocks of the scaled size
        assert writes > 0 or scale == 1.0
        shares[scale] = result["kv_share_of_bytes"]
    assert shares[1.0] < shares[2.0] < 1.0


def test_the_modelled_pass_counts_the_unfit_gathers_a_real_run_meets(tmp_path: Path) -> None:
    trace, scratch = _trace_and_scratch(tmp_path)
    budget = recorded_budget(read_trace(str(trace)))
    device = fit_waits(read_trace(str(trace)))
    assert device is not None
    for kv_scale in (1.0, 4.0):
        config = SimulationConfig("static_split", budget, device, 0.9, kv_bytes_scale=kv_scale)
        modelled = ssd_sharing.num_unfit_gathers(load_input(str(trace)), config)
        real = simulate_real(str(trace), [config], RealIO(str(scratch), pace=False))[0]["num_unfit_gathers"]
        assert modelled == real and (modelled > 0) == (kv_scale > 1.0)


"""``bench.validate_cells``' bookkeeping: which trace predicts which run, and the summary's counts and errors."""

from __future__ import annotations

import pytest

from fallbackgate.bench.validate_cells import DEVICES, _source_cell, summarize


def test_joint_is_predicted_from_the_static_split_and_every_other_run_from_joint() -> None:
    joint = {"workload": "mixed", "controller": "joint", "ram_frac": 0.25, "kv_share": None}
    static = {**joint, "controller": "static_split", "kv_share": 0.5}
    assert _source_cell(joint) == ("mixed", "static_split", 0.25, 0.3)
    assert _source_cell(static) == ("mixed", "joint", 0.25, None)


def test_the_summary_counts_cells_within_and_averages_signed_errors() -> None:
    def row(controller: str, stall: float, tpot: float, device: str = DEVICES[0]) -> dict:
        ok_stall, ok_tpot = abs(stall) <= 0.25, abs(tpot) <= 0.25
        return {"device": device, "controller": controller, "stall_error": stall, "tpot_error": tpot,
                "stall_within": ok_stall, "tpot_within": ok_tpot, "within_bound": ok_stall and ok_tpot}  # fmt: skip

    rows = [row("joint", -0.1, 0.0), row("joint", -0.3, 0.1), row("static_split", 0.2, -0.1)]
    rows.append({"device": DEVICES[0], "controller": "joint", "error": "TraceFormatError: no budget"})
    summary = summarize(rows)[DEVICES[0]]
    assert summary["failed"] == 1
    assert (summary["all"]["n"], summary["all"]["within"], summary["all"]["stall_within"]) == (3, 2, 2)
    assert summary["joint"]["stall_error"]["mean"] == pytest.approx(-0.2)
    assert summary["static_split"]["tpot_error"] == {"mean": -0.1, "lo": -0.1, "hi": -0.1, "n": 1}
    assert "joint" not in summarize(rows)[DEVICES[1]]  # no rows for that device

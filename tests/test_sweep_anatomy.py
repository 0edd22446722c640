"""The TPOT anatomy of sweep runs, from hand-built ledger rows: a request's parts add up to its TPOT, the stall
ceiling is the P99 gain of removing every expert stall, and a cell compares it with joint's measured gain."""

from __future__ import annotations

import pathlib

import pytest
from sqlalchemy.orm import Session

from fallbackgate.ledger.db import Ledger, LedgerError, open_ledger
from fallbackgate.ledger.models import Request, Run, Step, StepRequest
from fallbackgate.sweep.anatomy import markdown_table, request_anatomies, run_anatomy, sweep_anatomy, ttft_table

MS = 1e-3


def _run(
    ledger: Ledger, requests: dict[str, tuple], steps: list[tuple[str, float, float, list]], controller: str = "joint"
) -> int:
    """A run with `requests` (id -> (output tokens, TPOT s[, TTFT s, TTFT target ms])) and `steps` ((kind, wall s,
    exposed s, [(request id, is_sampled)])) in order."""
    with Session(ledger.engine) as db, db.begin():
        run = Run(controller=controller)
        db.add(run)
        db.flush()
        for rid, (num_output, tpot_s, *ttft) in requests.items():
            ttft_s, target_ms = ttft or (0.05, None)
            slo = None if target_ms is None else {"ttft_ms": target_ms, "tpot_ms": 100.0}
            db.add(Request(run_id=run.id, request_id=rid, num_output_tokens=num_output, tpot_s=tpot_s, ttft_s=ttft_s,
                           slo=slo))  # fmt: skip
        for step_id, (kind, wall_s, exposed_s, members) in enumerate(steps, 1):
            db.add(Step(run_id=run.id, step_id=step_id, kind=kind, num_requests=len(members), num_tokens=1,
                        wall_s=wall_s, transfer_exposed_s=exposed_s))  # fmt: skip
            for rid, is_sampled in members:
                db.add(StepRequest(run_id=run.id, step_id=step_id, request_id=rid, start_position=0, num_tokens=1,
                                   is_sampled=is_sampled, num_events=0, num_objects=0))  # fmt: skip
        return run.id


@pytest.fixture
def ledger(tmp_path: pathlib.Path) -> Ledger:
    return open_ledger(f"sqlite:///{tmp_path / 'l.db'}")


def test_a_requests_parts_add_up_to_its_tpot(ledger: Ledger) -> None:
    run_id = _run(
        ledger,
        {"a": (4, 10 * MS, 32 * MS, 30.0), "b": (1, 0.0), "c": (2, 20 * MS, 45 * MS, 30.0)},
        [
            ("prefill", 30 * MS, 5 * MS, [("a", True), ("c", False)]),  # a's first token: not a decode step
            ("mixed", 12 * MS, 2 * MS, [("a", True), ("c", True), ("b", True)]),
            ("decode", 8 * MS, 1 * MS, [("a", True), ("c", True)]),
            ("decode", 7 * MS, 0.0, [("a", True)]),
        ],
    )
    by_id = {a.request_id: a for a in request_anatomies(ledger, run_id)}
    assert set(by_id) == {"a", "c"}  # b had one token: no TPOT
    a = by_id["a"]
    assert a.stall_ms == pytest.approx(1.0)  # (2 + 1 + 0) ms over 3 tokens after the first
    assert a.prefill_step_ms == pytest.approx(10 / 3)
    assert a.decode_step_ms == pytest.approx(14 / 3)
    assert a.gap_ms == pytest.approx(1.0)  # 10 − 27 / 3
    assert a.tpot_ms == pytest.approx(10.0)  # as recorded: the four parts above add up to it
    c = by_id["c"]  # its first sampled step (the mixed one) ended its prefill; one decode step
    assert (c.stall_ms, c.decode_step_ms, c.gap_ms) == pytest.approx((1.0, 7.0, 12.0))
    summary = run_anatomy(list(by_id.values()))
    assert summary["tpot_p99_ms"] == pytest.approx(20.0)  # c is the slowest
    assert summary["stall_free_tpot_p99_ms"] == pytest.approx(19.0)
    assert summary["stall_ceiling"] == pytest.approx(0.05)
    assert summary["p99_request_gap_ms"] == pytest.approx(12.0)
    assert (a.ttft_own_steps_ms, a.ttft_own_stall_ms) == pytest.approx((30.0, 5.0))  # its prefill step
    assert (c.ttft_own_steps_ms, c.ttft_own_stall_ms) == pytest.approx((42.0, 7.0))  # two steps up to its token
    assert summary["ttft_met"] == 0.0  # 32 and 45 ms against 30
    assert summary["ttft_met_without_own_stall"] == 0.5  # a: 27 ms; c: 38 ms
    assert summary["ttft_ms"] == pytest.approx(38.5) and summary["ttft_target_ms"] == 30.0


def _decoding_run(ledger: Ledger, step_ms: float, stall_ms: float, controller: str) -> int:
    """One request of 11 tokens whose ten decode steps each take `step_ms`, `stall_ms` of it exposed reads."""
    steps = [("prefill", 0.01, 0.0, [("r", True)])] + [("decode", step_ms * MS, stall_ms * MS, [("r", True)])] * 10
    return _run(ledger, {"r": (11, step_ms * MS)}, steps, controller)


def test_a_cell_sets_each_partners_stall_ceiling_beside_joints_gain(ledger: Ledger) -> None:
    points = []
    for seed in (0, 1, 2):
        runs = {("joint", None): (8.0, 1.0), ("independent_lru", None): (10.0, 4.0 + seed)}
        runs |= {("static_split", share): (10.0 + share, 2.0) for share in (0.1, 0.5)}
        for (controller, share), (step_ms, stall_ms) in runs.items():
            points.append({"workload": "w", "ram_frac": 0.5, "seed": seed, "controller": controller,
                           "kv_share": share, "run_id": _decoding_run(ledger, step_ms, stall_ms, controller),
                           "metrics": {"slo_attainment": 0.5, "tpot_p99_ms": step_ms}})  # fmt: skip
    cell = sweep_anatomy(points, ledger, held_out=2)["w@0.5"]
    assert cell["chosen_static_kv_share"] == 0.1  # the faster split
    lru = cell["vs"]["independent_lru"]
    assert lru["stall_ceiling"]["mean"] == pytest.approx(0.5)  # stalls 4, 5, 6 of 10 ms
    assert lru["stall_ceiling"]["lo"] < 0.5 < lru["stall_ceiling"]["hi"]
    assert lru["joint_tpot_p99_gain"]["mean"] == pytest.approx(0.2)  # 8 against 10 ms
    static = cell["vs"]["chosen_static"]
    assert static["stall_ceiling"]["mean"] == pytest.approx(2 / 10.1)
    assert cell["mean"]["joint"]["p99_request_stall_ms"] == pytest.approx(1.0)
    table = markdown_table({"w@0.5": cell})
    assert "| w@0.5 | 1.0 + 0.0 + 7.0 + 0.0 /" in table and "+50 [" in table
    assert "ttft_met" not in cell["mean"]["joint"]  # no SLO, no attainment
    assert "| w@0.5 | nan | 50.0 (10.0; 0.0) / 50.0 (10.0; 0.0) / 50.0 (10.0; 0.0) | – / – / – |" in ttft_table(
        {"w@0.5": cell}
    )


def test_another_sweeps_ledger_is_refused(ledger: Ledger) -> None:
    run_id = _decoding_run(ledger, 10.0, 1.0, "static_split")
    point = {"workload": "w", "ram_frac": 0.5, "seed": 0, "controller": "joint", "kv_share": None}
    with pytest.raises(LedgerError, match=f"run {run_id} \\(joint, w seed 0\\) is a static_split run"):
        sweep_anatomy([point | {"run_id": run_id}], ledger, held_out=2)
    with pytest.raises(LedgerError, match="run 99 .* is not in it"):
        sweep_anatomy([point | {"run_id": 99}], ledger, held_out=2)
    twin = _decoding_run(ledger, 10.0, 1.0, "joint")  # the same run id and controller, another sweep's timing
    timed = point | {"run_id": twin, "metrics": {"tpot_p99_ms": 12.5}}
    with pytest.raises(LedgerError, match="has P99 TPOT 10.0000 ms in .*, the sweep says 12.5000"):
        sweep_anatomy([timed], ledger, held_out=2)
    assert sweep_anatomy([timed | {"metrics": {"tpot_p99_ms": 10.0}}], ledger, held_out=2)["w@0.5"]

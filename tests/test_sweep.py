"""Belady's MIN on hand-checked traces, the trace recorder, and a tiny end-to-end sweep's JSON, PNG and ledger."""

from __future__ import annotations

import json
import pathlib
import random

import pytest
from sqlalchemy import select

from fallbackgate.cli import main
from fallbackgate.dashboard import sweep_data
from fallbackgate.ledger.db import open_ledger
from fallbackgate.ledger.models import Run
from fallbackgate.sweep.belady import belady_misses, lru_misses
from fallbackgate.sweep.metrics import _p99, headline

# The textbook reference string 1 2 3 4 1 2 5 1 2 3 4 5 (as (layer, expert) keys).
TEXTBOOK = [(0, e) for e in (1, 2, 3, 4, 1, 2, 5, 1, 2, 3, 4, 5)]


@pytest.mark.parametrize(("slots", "optimal", "lru"), [(3, 7, 10), (4, 6, 8), (5, 5, 5), (1, 12, 12)])
def test_belady_on_the_textbook_trace(slots: int, optimal: int, lru: int) -> None:
    # 3 slots by hand: misses 1 2 3, 4 evicts 3 (next use 9, farthest); hits 1 2; 5 evicts 4 (next use 10 vs 1@7
    # 2@8); hits 1 2; 3 evicts 1 (never again), 4 evicts 3 or 2; hit 5 -> 7 misses. LRU: 10 (Belady's anomaly table).
    assert belady_misses(TEXTBOOK, slots) == optimal
    assert lru_misses(TEXTBOOK, slots) == lru


def test_belady_small_hand_trace_across_layers() -> None:
    # 2 slots: a b a c a b -> misses a, b, c (evicts b: next use 5 vs a@4), b (evicts c or a; a never again) = 4
    a, b, c = (0, 0), (1, 0), (1, 1)
    assert belady_misses([a, b, a, c, a, b], 2) == 4
    assert lru_misses([a, b, a, c, a, b], 2) == 4  # LRU: c evicts b, then b evicts c: also 4 here
    assert belady_misses([], 3) == 0


def test_belady_bounds_lru_and_compulsory_misses() -> None:
    rng = random.Random(7)
    for _ in range(50):
        trace = [(rng.randrange(3), rng.randrange(6)) for _ in range(rng.randrange(1, 120))]
        distinct = len(set(trace))
        for slots in (1, 2, 4, 8, 32):
            opt = belady_misses(trace, slots)
            assert distinct <= opt <= lru_misses(trace, slots)
            if slots >= distinct:
                assert opt == distinct
        assert belady_misses(trace, 2) >= belady_misses(trace, 3)  # MIN has no anomaly


def test_belady_rejects_zero_slots() -> None:
    with pytest.raises(ValueError, match="num_slots"):
        belady_misses(TEXTBOOK, 0)


def test_p99_nearest_rank() -> None:
    assert _p99([]) == 0.0
    assert _p99([3.0]) == 3.0
    assert _p99([float(i) for i in range(1, 101)]) == 99.0
    assert _p99([1.0, 2.0]) == 2.0


def test_headline_compares_joint_with_the_best_static_split() -> None:
    def point(ctrl: str, tpot: float, exact: float, belady: float, **extra: float) -> dict:
        cell = {"expert_frac": 0.4, "kv_frac": 0.5, "device_budget_mb": 5.0, "run_id": 1}
        cell |= {"expert_budget_bytes": 4, "kv_budget_bytes": 1}
        metrics = {"tpot_mean_ms": tpot, "modeled_tpot_mean_ms": 2 * tpot, "expert_exact_bytes": exact}
        metrics |= {"belady_expert_bytes": belady}
        metrics |= {"belady_expert_bytes_all_slots": belady / 2, "slo_attainment": 0.5}
        return {"controller": ctrl, **cell, **extra, "metrics": metrics}

    points = [
        point("joint", 0.6, 120.0, 90.0),
        point("static_split", 1.0, 150.0, 100.0),
        point("exact_lru", 1.2, 160.0, 100.0),
        point("static_split", 0.8, 140.0, 100.0, static_frac=0.9),
    ]
    h = headline(points, 0.4)
    assert h["exact_trace_from"] == "exact_lru"
    assert h["joint_over_belady"] == pytest.approx(1.2)
    assert h["best_static_tpot_ms"] == 0.8 and h["best_static_split_expert_share"] == 0.9
    assert h["joint_tpot_gain"] == pytest.approx(0.25)  # measured
    assert h["joint_modeled_tpot_gain"] == pytest.approx(0.25)  # the what-if, beside it


def test_tiny_sweep_writes_points_png_and_ledger_runs(checkpoint_factory, tmp_path: pathlib.Path) -> None:
    model = checkpoint_factory("qwen3_moe")
    out, db = tmp_path / "out", tmp_path / "ledger.sqlite"
    argv = ["sweep", "--model", str(model), "--expert-fracs", "0.4,0.8", "--kv-fracs", "1.0"]
    argv += ["--controllers", "joint,exact_lru", "--chats", "2", "--long", "1", "--long-tokens", "48"]
    argv += ["--max-new-tokens", "4", "--out", str(out), "--ledger", str(db), "--quiet"]
    assert main(argv) == 0
    doc = json.loads((out / "sweep.json").read_text())
    assert (out / "sweep.png").stat().st_size > 10_000
    points = doc["points"]
    assert [(p["controller"], p["expert_frac"]) for p in points] == [
        ("joint", 0.4),
        ("exact_lru", 0.4),
        ("joint", 0.8),
        ("exact_lru", 0.8),
    ]
    assert doc["static_split_at_headline"] == []  # static_split not swept
    ref = doc["reference"]
    for p in points:
        m = p["metrics"]
        assert p["expert_budget_bytes"] == int(p["expert_frac"] * ref["expert_bytes_total"])
        assert p["kv_budget_bytes"] == ref["peak_kv_bytes"]
        assert m["num_audited"] == 3 and 0.0 <= m["slo_attainment"] <= 1.0
        assert m["modeled_tpot_mean_ms"] > 0 and m["modeled_tpot_p99_ms"] >= m["modeled_tpot_mean_ms"] * (1 - 1e-9)
        assert m["tpot_mean_ms"] > 0 and m["tpot_p99_ms"] >= m["tpot_mean_ms"] * (1 - 1e-9)  # measured wall clock
        assert m["trace_len"] > 0 and m["expert_slots"] == p["expert_budget_bytes"] // ref["bytes_per_expert"]
        assert m["belady_expert_bytes"] % ref["bytes_per_expert"] == 0
        assert m["belady_expert_bytes_all_slots"] <= m["belady_expert_bytes"] <= m["lru_expert_bytes"]
        assert m["bytes_total"] >= m["bytes_exact"] == m["expert_exact_bytes"] + m["kv_exact_bytes"]
        assert sum(v for k, v in m.items() if k.startswith("tag_")) <= 1.0 + 1e-9
    for p in points[1::2]:  # exact_lru: exact, and never fewer expert loads than the offline optimum
        m = p["metrics"]
        assert m["gate_passed"] == 1.0 and m["mean_kl"] < 1e-6
        assert m["tag_expert_defer"] == m["tag_kv_dequant"] == m["tag_expert_lowbit"] == 0.0
        assert m["expert_exact_bytes"] >= m["belady_expert_bytes_all_slots"]
    # more expert budget, fewer loads (same exact trace)
    assert points[3]["metrics"]["expert_exact_bytes"] <= points[1]["metrics"]["expert_exact_bytes"]
    assert doc["headline"]["exact_trace_from"] == "exact_lru"
    ledger = open_ledger(str(db))
    with ledger.engine.connect() as conn:
        runs = conn.execute(select(Run.id, Run.controller, Run.note, Run.status).order_by(Run.id)).all()
    ledger.close()
    assert [r.id for r in runs] == [p["run_id"] for p in points]
    assert [r.controller for r in runs] == [p["controller"] for p in points]
    assert all(r.status == "complete" and r.note.startswith(f"sweep {doc['sweep_id']} {{") for r in runs)
    assert json.loads(runs[0].note.split(" ", 2)[2])["expert_frac"] == 0.4
    df, problems = sweep_data.load_sweep(None, str(out / "sweep.json"))  # what the Budget sweep page shows
    assert problems == [] and len(df) == 4 and df["budget_unit"].eq("MB").all()
    assert {"modeled_tpot_mean_ms", "expert_exact_bytes", "slo_attainment"} <= set(sweep_data.metric_columns(df))


def test_sweep_rejects_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["sweep", "--controllers", "joint,nope"])
    with pytest.raises(SystemExit):
        main(["sweep", "--expert-fracs", "0,0.5"])
    assert "fractions must be in (0, 4]" in capsys.readouterr().err

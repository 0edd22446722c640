"""The batched writer: round trips on SQLite and PostgreSQL, background flushing, error surfacing."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from sqlalchemy import func, select

from fallbackgate.audit.stats import audit
from fallbackgate.engine.tags import TAG_EXACTNESS, Tag
from fallbackgate.ledger import queries
from fallbackgate.ledger.db import LedgerError, open_ledger
from fallbackgate.ledger.models import EventRow, Step
from fallbackgate.ledger.synthetic import synthetic_output, synthetic_step
from fallbackgate.ledger.writer import LedgerWriter
from tests.pg_fixture import pg_server_fixture, pg_url_fixture  # noqa: F401 - fixtures


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "l.sqlite")
    return str(request.getfixturevalue("pg_url"))


def test_round_trip(url: str) -> None:
    ledger = open_ledger(url)
    steps = [synthetic_step(i, ["a", "b"], num_layers=3, events_per_layer=2) for i in range(5)]
    out = synthetic_output("a", num_output=5, vocab=16, tag_counts={"resident": 10, "exact_load": 2})
    with LedgerWriter(ledger, flush_interval_s=0.05) as w:
        run_id = w.start_run(
            policy="x: 1",
            model_path="/m",
            hardware_profile={"pcie_gbps": 25},
            mode="enforce",
        )
        for plan, result in steps:
            w.record_step(plan, result)
        w.record_request(out, slo={"ttft_s": 1.0}, budget={"max_mean_kl": 0.5}, prompt="hi")
        exact = out.output_logits + 0.1 * torch.randn(5, 16, generator=torch.Generator().manual_seed(3))
        diffs, stats = audit(exact, out.output_logits, out.output_token_ids)
        w.record_diffs("a", diffs, stats)
        w.record_control(2e-7)
        w.record_verdict("a", False, "too much KL", step=2, layer=1, tags=["expert_defer"])
        w.finish_run(status="complete")
    events = [e for _, r in steps for e in r.events]
    with ledger.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(EventRow)).scalar() == len(events)
        assert conn.execute(select(func.sum(EventRow.count))).scalar() == sum(e.count for e in events)
        assert conn.execute(select(func.count()).select_from(Step)).scalar() == 5
        pairs = set(conn.execute(select(EventRow.tag, EventRow.exactness).distinct()).all())
    assert pairs == {(t.value, c.value) for t, c in TAG_EXACTNESS.items()}
    run = queries.get_run(ledger, run_id)
    assert run is not None and run["status"] == "complete" and run["finished_at"] is not None
    assert run["numeric_floor_kl"] == pytest.approx(2e-7) and run["hardware_profile"] == {"pcie_gbps": 25}
    (req,) = queries.request_summaries(ledger, run_id)
    assert req["verdict"] == "fail" and req["budget"] == {"max_mean_kl": 0.5} and req["slo"] == {"ttft_s": 1.0}
    assert req["mean_kl"] == pytest.approx(stats.mean_kl) and req["num_positions"] == 5
    assert req["ttft_s"] == pytest.approx(0.5) and req["tag_counts"] == {
        "resident": 10,
        "exact_load": 2,
    }
    pds = queries.position_diffs(ledger, run_id, "a")
    assert [d["step_id"] for d in pds] == [
        0,
        1,
        2,
        3,
        4,
    ]  # i-th output token <- i-th sampling step
    assert [d["kl"] for d in pds] == pytest.approx([d.kl for d in diffs])
    (listed,) = queries.list_runs(ledger)
    counts = {c: sum(e.count for e in events if e.tag.exactness.value == c) for c in ("exact", "equivalent")}
    assert listed["objects_exact"] == counts["exact"] and listed["objects_equivalent"] == counts["equivalent"]
    rows = queries.run_tag_counts(ledger, run_id)
    loads = sum(r["objects"] for r in rows if r["tag"] == Tag.EXACT_LOAD.value)
    assert loads == sum(e.count for e in events if e.tag is Tag.EXACT_LOAD)
    moved = sum(r["bytes_moved"] for r in rows)
    assert moved == sum(e.bytes_moved for e in events) > 0
    grid = queries.request_events(ledger, run_id, "a", step_id=2)
    assert {(g["layer"], g["tag"]) for g in grid} == {
        (e.layer, e.tag.value) for e in steps[2][1].events if e.request_id == "a"
    }
    verdicts = queries.verdicts(ledger, run_id)
    assert verdicts[0]["first_divergence_tags"] == ["expert_defer"] and verdicts[0]["passed"] is False
    ledger.close()


def test_background_flush_without_explicit_flush(tmp_path: Path) -> None:
    ledger = open_ledger(str(tmp_path / "l.sqlite"))
    w = LedgerWriter(ledger, flush_interval_s=0.05)
    w.start_run()
    start = time.perf_counter()
    w.record_step(*synthetic_step(0, ["a"]))
    assert time.perf_counter() - start < 0.05  # the caller does not wait for the database
    deadline = time.monotonic() + 5.0
    with ledger.engine.connect() as conn:
        while conn.execute(select(func.count()).select_from(EventRow)).scalar() == 0:
            assert time.monotonic() < deadline, "events never flushed"
            time.sleep(0.02)
            conn.rollback()
    run = queries.get_run(ledger, w.run_id or 0)
    assert run is not None and run["status"] == "incomplete"  # stored "running": reported incomplete
    w.close()
    ledger.close()


def test_background_errors_surface_on_next_call(tmp_path: Path) -> None:
    ledger = open_ledger(str(tmp_path / "l.sqlite"))
    w = LedgerWriter(ledger)
    w.start_run()
    w.record_step(*synthetic_step(0, ["a"]), run_id=999)  # no such run: foreign key violation
    with pytest.raises(LedgerError, match="ledger writer failed"):
        w.flush()
    with pytest.raises(LedgerError):
        w.close()
    with pytest.raises(LedgerError, match="no run"):
        LedgerWriter(ledger).record_step(*synthetic_step(0, ["a"]))
    ledger.close()


def test_finish_status_is_validated(tmp_path: Path) -> None:
    with open_ledger(str(tmp_path / "l.sqlite")) as ledger, LedgerWriter(ledger) as w:
        run_id = w.start_run()
        with pytest.raises(ValueError, match="finish status"):
            w.finish_run(run_id, "running")
        w.finish_run(run_id, "failed")
        assert queries.get_run(ledger, run_id)["status"] == "failed"  # type: ignore[index]

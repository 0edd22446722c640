"""Read queries: run list and tag mix, drift, calibration pairs, observe steps, delete_run."""

from __future__ import annotations

from pathlib import Path

import pytest

from fallbackgate.audit.stats import PositionDiff, request_stats
from fallbackgate.engine.tags import Tag
from fallbackgate.ledger import queries
from fallbackgate.ledger.db import Ledger, open_ledger
from fallbackgate.ledger.synthetic import synthetic_output, synthetic_step
from fallbackgate.ledger.writer import LedgerWriter, delete_run


def _diffs(kls: list[float]) -> list[PositionDiff]:
    return [PositionDiff(i, 0, kl, True, 0.0, 0.0, True, -1.0, -1.0) for i, kl in enumerate(kls)]


def _run(ledger: Ledger, kls: list[float], tags: list[Tag], observe: bool = False, finish: bool = True) -> int:
    with LedgerWriter(ledger) as w:
        run_id = w.start_run(mode="observe" if observe else "enforce")
        for i in range(len(kls)):
            plan, result = synthetic_step(i, ["a"], num_layers=2, events_per_layer=1, tags=tags)
            plan.is_observe = observe
            w.record_step(plan, result)
        w.record_request(synthetic_output("a", num_output=len(kls)))
        w.record_diffs("a", _diffs(kls), request_stats(_diffs(kls)))
        if finish:
            w.finish_run()
    return run_id


@pytest.fixture
def ledger(tmp_path: Path) -> Ledger:
    return open_ledger(str(tmp_path / "q.sqlite"))


def test_list_runs_mix_and_status(ledger: Ledger) -> None:
    first = _run(ledger, [0.0, 0.0], [Tag.RESIDENT])
    second = _run(ledger, [0.1, 0.3], [Tag.RESIDENT, Tag.EXPERT_DEFER], finish=False)
    runs = queries.list_runs(ledger)
    assert [r["id"] for r in runs] == [second, first]  # newest first
    assert runs[0]["status"] == "incomplete" and runs[1]["status"] == "complete"
    # synthetic counts: event i has count 1 + i % 3; 2 layers x 1 event per step, 2 steps
    assert (runs[1]["objects_exact"], runs[1]["objects_approximate"]) == (1 + 2 + 1 + 2, 0)
    assert (runs[0]["objects_exact"], runs[0]["objects_approximate"]) == (1 + 1, 2 + 2)
    assert queries.latest_run_id(ledger) == second
    assert queries.get_run(ledger, 12345) is None


def test_drift_and_calibration_pairs(ledger: Ledger) -> None:
    a = _run(ledger, [0.0, 0.2], [Tag.EXPERT_DEFER])
    b = _run(ledger, [0.4, 0.6], [Tag.KV_DEQUANT])
    drift = queries.drift(ledger)
    assert [d["run_id"] for d in drift] == [a, b]  # oldest first
    assert drift[0]["mean_kl"] == pytest.approx(0.1) and drift[1]["max_kl"] == pytest.approx(0.6)
    pairs = queries.calibration_pairs(ledger, run_id=b)
    assert {(p["step_id"], p["layer"]) for p in pairs} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert {p["tag"] for p in pairs} == {"kv_dequant"}
    assert sorted({p["measured_kl"] for p in pairs}) == pytest.approx([0.4, 0.6])  # KL of the step's position
    assert all(p["predicted"] > 0 for p in pairs)
    assert queries.calibration_pairs(ledger, tag="expert_defer")[0]["run_id"] == a


def test_observe_steps_count_the_tags_they_recorded_as_served(ledger: Ledger) -> None:
    # an observe step records the tag it served (a fault's forced expert_defer is served even there)
    observed = _run(ledger, [0.0], [Tag.RESIDENT, Tag.EXPERT_DEFER], observe=True)
    enforced = _run(ledger, [0.0], [Tag.RESIDENT, Tag.EXPERT_DEFER])
    assert queries.request_exactness(ledger, observed)["a"]["approximate"] == 2
    assert queries.request_exactness(ledger, enforced)["a"]["approximate"] == 2
    assert queries.request_tags(ledger, observed)["a"] == {"resident": 1, "expert_defer": 2}


def test_delete_run_removes_everything(ledger: Ledger) -> None:
    keep = _run(ledger, [0.0], [Tag.RESIDENT])
    gone = _run(ledger, [0.5], [Tag.EXPERT_DEFER])
    delete_run(ledger, gone)
    assert queries.get_run(ledger, gone) is None and queries.run_tag_counts(ledger, gone) == []
    assert queries.request_summaries(ledger, gone) == [] and queries.position_diffs(ledger, gone, "a") == []
    assert len(queries.request_summaries(ledger, keep)) == 1 and queries.run_tag_counts(ledger, keep)

"""Ledger volume (issue 27 item 5): rows per generated token are bounded by the step, not layers × requests."""

from __future__ import annotations

import pathlib

from sqlalchemy import select

from fallbackgate.bench.ledger_volume import count_rows, synthetic_step
from fallbackgate.engine.step_context import EventLog
from fallbackgate.engine.tags import ObjectKind, Tag, Tier
from fallbackgate.ledger.db import open_ledger
from fallbackgate.ledger.models import Step, StepRequest
from fallbackgate.ledger.writer import LedgerWriter


def test_only_plain_resident_expert_uses_become_counts() -> None:
    log = EventLog(3)
    log.add("a", 0, ObjectKind.EXPERT, Tag.RESIDENT)
    log.add("a", 0, ObjectKind.EXPERT, Tag.RESIDENT, count=2)
    log.add("a", 2, ObjectKind.EXPERT, Tag.RESIDENT)
    log.add("a", 1, ObjectKind.EXPERT, Tag.RESIDENT, note="observe: would serve expert_defer")  # a decision: kept
    log.add("a", 1, ObjectKind.EXPERT, Tag.EXACT_LOAD, bytes_moved=10, source_tier=Tier.HOST)  # a miss: kept
    log.add("a", 1, ObjectKind.KV_BLOCK, Tag.RESIDENT)  # not an expert: kept
    log.is_rebuild_pass = True
    log.add("a", 1, ObjectKind.EXPERT, Tag.RESIDENT)  # a rebuild pass's use is evidence of the rebuild: kept
    assert log.expert_resident_uses == {"a": {0: 3, 2: 1}}
    assert sorted((e.layer, e.tag.value, e.count, e.is_rebuild) for e in log.events()) == [
        (1, "exact_load", 1, False),
        (1, "resident", 1, False),
        (1, "resident", 1, False),
        (1, "resident", 1, True),
    ]


def test_rows_per_token_are_bounded_by_the_step(tmp_path: pathlib.Path) -> None:
    num_steps, batch, layers, top_k = 3, 4, 48, 8
    with open_ledger(str(tmp_path / "v.sqlite")) as ledger:
        writer = LedgerWriter(ledger)
        run_id = writer.start_run(note="volume")
        for step in range(1, num_steps + 1):
            writer.record_step(*synthetic_step(step, batch, layers, top_k))
        writer.finish_run()
        writer.close()
        rows = count_rows(ledger, run_id)
        assert rows == {"steps": num_steps, "step_requests": num_steps * batch, "events": 0, "event_objects": 0}
        with ledger.engine.connect() as conn:
            steps = conn.execute(select(Step.num_resident_expert_uses, Step.num_resident_kv_reads)).all()
            per_request = conn.execute(
                select(StepRequest.num_resident_expert_uses, StepRequest.resident_expert_uses)
            ).all()
    assert steps == [(batch * layers * top_k, batch * layers * 4)] * num_steps
    assert per_request == [(layers * top_k, ",".join(["8"] * layers))] * (num_steps * batch)

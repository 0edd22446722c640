"""Expert reads on I/O threads: the same tokens and logits bit for bit as reads on the compute thread, a
transfer clock that adds up, host-budget room held by every read in flight, and the ledger's step columns."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from sqlalchemy import select

from fallbackgate.cli import main
from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.engine.tags import ObjectKind
from fallbackgate.ledger.db import open_ledger
from fallbackgate.ledger.models import Step
from tests.checkpoints import make_checkpoint

PROMPTS = ([5, 17, 33, 9, 101, 250, 7, 64, 12, 3, 88], [44, 2, 190, 31, 6], [9, 9, 14, 200, 3, 71])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_checkpoint("olmoe", tmp_path_factory.mktemp("ra") / "olmoe", dtype=torch.bfloat16)


def _engine(path: pathlib.Path, num_io_threads: int) -> Engine:
    probe = Engine(EngineConfig(model_dir=str(path), block_size=4), ExactLRUController())
    expert, block = probe.expert_store.bytes_per_expert, probe.kv_store.bytes_per_block
    device = 3 * expert + 40 * probe.kv_store.num_layers * block
    budgets = {"device_budget_bytes": device, "host_budget_bytes": 5 * expert, "is_emulated_device_tier": True}
    return Engine(
        EngineConfig(model_dir=str(path), block_size=4, max_num_seqs=3, num_io_threads=num_io_threads, **budgets),
        ExactLRUController(),
    )


def _host_bytes_held(engine: Engine) -> int:
    store = engine.expert_store
    cached = sum(1 for e in store.entries.values() if e.host is not None)
    return (cached + len(store.read_ahead.flights)) * store.bytes_per_expert


def test_reads_ahead_change_no_bit_and_their_clock_adds_up(checkpoint: pathlib.Path) -> None:
    params = SamplingParams(max_new_tokens=8)
    serial = _engine(checkpoint, 0)
    reference = serial.generate([list(p) for p in PROMPTS], params)
    engine = _engine(checkpoint, 2)
    assert engine.expert_store.is_disk_tiered and engine.executor.routers  # every layer's router was found
    warm_reads = engine.expert_store.num_disk_reads
    for sid, prompt in enumerate(PROMPTS):
        engine.add_request(list(prompt), params, request_id=f"r{sid}")
    clocks = []
    while engine.has_unfinished():
        result = engine.step()
        clocks.append(result.transfer)
        # every read in flight holds its host room: the host pool counts cached copies plus flights
        assert engine.expert_store.host_pool.used_bytes_by_kind[ObjectKind.EXPERT] == _host_bytes_held(engine)
    outputs = [engine.finished[f"r{i}"] for i in range(len(PROMPTS))]
    for got, want in zip(outputs, reference, strict=True):
        assert got.output_token_ids == want.output_token_ids
        assert torch.equal(got.output_logits, want.output_logits)
    consumed = sum(c.num_predicted_used + c.num_unpredicted for c in clocks)
    assert consumed == engine.expert_store.num_disk_reads - warm_reads > 20
    assert sum(c.num_predicted for c in clocks) > 0  # the next layer's router started reads
    assert 0 < sum(c.num_predicted_used for c in clocks) <= sum(c.num_predicted for c in clocks)
    assert all(c.transfer_s >= 0 and 0 <= c.exposed_s <= c.transfer_s + 1e-3 for c in clocks)
    serial_clock = serial.expert_store.read_ahead.total
    assert serial_clock.num_predicted == 0 and serial_clock.exposed_s == pytest.approx(serial_clock.transfer_s)


def test_run_reports_and_records_the_transfer_clock(checkpoint: pathlib.Path, tmp_path: pathlib.Path) -> None:
    ledger, out = tmp_path / "l.sqlite", tmp_path / "r.json"
    args = ["run", "--model", str(checkpoint), "--device-budget-mb", "0.64",
            "--max-new-tokens", "6", "--io-threads", "2", "--ledger", str(ledger), "--json", str(out),
            "--quiet"]  # fmt: skip
    assert main(args) == 0
    reads = json.loads(out.read_text())["expert_reads"]
    assert reads["read_s"] > 0 and reads["num_predicted"] > 0
    assert reads["hidden_s"] + reads["exposed_s"] == pytest.approx(reads["read_s"])
    assert 0 <= reads["prefetch_precision"] <= 1 and 0 <= reads["prefetch_recall"] <= 1
    with open_ledger(str(ledger)).engine.connect() as conn:
        rows = conn.execute(select(Step.transfer_s, Step.num_predicted_reads, Step.num_unpredicted_reads)).all()
    assert sum(r[0] for r in rows) == pytest.approx(reads["read_s"])
    assert sum(r[1] for r in rows) == reads["num_predicted"]
    assert sum(r[2] for r in rows) == reads["num_unpredicted"]


def test_close_gives_back_the_host_room_of_reads_in_flight(checkpoint: pathlib.Path) -> None:
    engine = _engine(checkpoint, 2)
    store = engine.expert_store
    disk_only = [k for k, e in store.entries.items() if e.host is None and e.device is None]
    store.queue_reads(disk_only[: store.num_read_slots], [], step_id=1)
    assert store.read_ahead.flights
    engine.close()
    assert not store.read_ahead.flights
    assert store.host_pool.used_bytes_by_kind[ObjectKind.EXPERT] == _host_bytes_held(engine)

"""Kept prefix blocks in a simulation: a finished request's full blocks stay in the budget and a later request
with the same content adopts them (read where they are) instead of writing its own, as the engine does."""

from __future__ import annotations

from pathlib import Path

from fallbackgate.engine.kv.prefix_types import PREFIX_ID
from fallbackgate.engine.tags import Tier
from fallbackgate.tracing import TraceTable, TraceWriter
from fallbackgate.tracing.devices import DeviceModel
from fallbackgate.tracing.simulate import SimulationConfig
from fallbackgate.tracing.simulate_input import load_input
from fallbackgate.tracing.simulator import Simulator

MODEL = {"num_layers": 1, "num_experts": 2, "top_k": 1, "bytes_per_expert": 1000, "bytes_per_kv_block": 100}
DEVICE = DeviceModel("flat", 100_000, 2e9)
H0, H9 = 11, 19  # the content of a's block, which b shares, and of c's


def _write(path: Path, num_layers: int = 1) -> None:
    """Request a reads its one full block in steps 0-1, c another content in step 2, b a's content in
    steps 3-4 (every layer's block); each step uses expert 0 of layer 0."""
    reads = [("a", 0, H0), ("a", 1, H0), ("c", 2, H9), ("b", 3, H0), ("b", 4, H0)]
    n = len(reads)
    model = {**MODEL, "num_layers": num_layers}
    metadata = {"model": model, "controller": "independent_lru", "budgets": {"device_bytes": 10**6}}
    with TraceWriter(path, metadata) as writer:
        writer.append(TraceTable.STEPS, step=list(range(n)), phase=["decode"] * n,
                      start_ns=[s * 10**6 for s in range(n)], end_ns=[s * 10**6 + 900_000 for s in range(n)],
                      batch=[1] * n, tokens=[1] * n)  # fmt: skip
        rows = {"step": [s for _, s, _ in reads], "request": [r for r, _, _ in reads], "layer": [0] * n,
                "tier_before": ["device"] * n, "tag": ["resident"] * n, "bytes": [0] * n, "ns": [0] * n}  # fmt: skip
        writer.append(TraceTable.EXPERT_ACCESS, **rows, expert=[0] * n, router_rank=[0] * n, router_weight=[1.0] * n,
                      is_predicted=[False] * n)  # fmt: skip
        kv = [(r, step, h, layer) for r, step, h in reads for layer in range(num_layers)]
        writer.append(TraceTable.KV_ACCESS, step=[k[1] for k in kv], request=[k[0] for k in kv],
                      layer=[k[3] for k in kv], block=[0] * len(kv), content_hash=[k[2] for k in kv],
                      tier_before=["device"] * len(kv), tag=["resident"] * len(kv), bytes=[0] * len(kv),
                      ns=[0] * len(kv))  # fmt: skip
        writer.append(TraceTable.REQUESTS, request=["a", "c", "b"], request_class=["x"] * 3, slo_ttft_ns=None,
                      slo_tpot_ns=[None] * 3, arrival_ns=[0] * 3, first_token_ns=[None] * 3, finish_ns=[None] * 3,
                      prompt_tokens=[16] * 3, output_tokens=[1] * 3)  # fmt: skip


def _run(path: Path, budget: int, steps: int) -> Simulator:
    simulator = Simulator(load_input(str(path)), SimulationConfig("independent_lru", budget, DEVICE))
    for index in range(steps):
        simulator.step(index)
    return simulator


def test_a_finished_requests_full_blocks_are_kept_and_adopted(tmp_path: Path) -> None:
    _write(tmp_path / "t")
    kept = _run(tmp_path / "t", 10**6, 2)  # a ended: its block is kept
    pid = f"{PREFIX_ID}{H0:016x}"
    assert list(kept.view.kv) == [(pid, 0, 0)]
    info = kept.view.prefix_entry(pid)
    assert info.num_on_device == 1 and info.num_hits == 0 and info.is_session  # b reads its content later
    done = _run(tmp_path / "t", 10**6, 5)
    assert done.view.prefix.num_reused == 1 and done.view.prefix.num_kept == 3  # a, c, then b (its adopted block)
    assert done.tally.tags == {"expert:exact_load": 1}  # adopted on device: no KV write, no KV miss
    assert done.tally.hits["kv"] == 3  # a's second read, b's adoption and its second read


def test_a_kept_block_taken_off_device_is_read_back_when_adopted(tmp_path: Path) -> None:
    _write(tmp_path / "t")
    room = MODEL["bytes_per_expert"] + MODEL["bytes_per_kv_block"]  # the expert and one block
    done = _run(tmp_path / "t", room, 5)  # c's write takes the kept block's room (LRU: KV gives KV room)
    assert done.tally.tags["kv:exact_load"] == 1 and done.view.prefix.num_reused == 1
    assert done.tally.spill_bytes >= MODEL["bytes_per_kv_block"]


def test_an_entry_that_lost_its_exact_copy_is_forgotten_and_its_content_kept_again(tmp_path: Path) -> None:
    _write(tmp_path / "t")
    simulator = _run(tmp_path / "t", 10**6, 2)
    view = simulator.view
    view.set_kv((f"{PREFIX_ID}{H0:016x}", 0, 0), (None, None, 0))  # what a controller's DROP leaves
    for index in range(2, 5):
        simulator.step(index)
    assert view.prefix.num_reused == 0 and view.prefix.num_kept == 3  # a's, c's, then b's own H0
    assert "kv:exact_load" not in simulator.tally.tags  # b computed its block: nothing to read back


def test_adoption_takes_every_layer_of_the_entry_at_once(tmp_path: Path) -> None:
    _write(tmp_path / "t", num_layers=2)
    simulator = _run(tmp_path / "t", 10**6, 3)
    view = simulator.view
    assert (f"{PREFIX_ID}{H0:016x}", 1, 0) in view.kv
    simulator.kv_read(3, ("b", 0, 0), (set(), set()), H0)  # b's first read, layer 0
    assert ("b", 1, 0) in view.kv and not any(k[0] == f"{PREFIX_ID}{H0:016x}" for k in view.kv)
    assert view.prefix.num_reused == 1


def test_a_block_read_back_is_staged_and_the_joint_controller_promotes_it(tmp_path: Path) -> None:
    """b adopts a's kept block after it left the device: read back once in step 3, then promoted at the step's
    end (the controller sees it staged, as the engine's view shows its scratch), so step 4 reads it in place."""
    _write(tmp_path / "t")
    simulator = Simulator(load_input(str(tmp_path / "t")), SimulationConfig("joint", 10**6, DEVICE))
    for index in range(3):
        simulator.step(index)
    simulator.view.set_kv((f"{PREFIX_ID}{H0:016x}", 0, 0), (Tier.HOST, None, 0))  # spilled with an exact copy
    simulator.step(3)
    assert simulator.tally.tags["kv:exact_load"] == 1 and simulator.view.kv[("b", 0, 0)][0] is Tier.DEVICE
    simulator.step(4)
    assert simulator.tally.tags["kv:exact_load"] == 1 and not simulator.view.staged

"""Deadlines that leave out the measured step time (``controller.step_time: measured``), fallbacks offered
when they arrive sooner than a late exact copy, and CPU spills that keep both a full and an int8 copy on
disk — what makes the bundled demo choose among its tags on a 2-core machine whose profile is optimistic."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch

from fallbackgate.controllers import JointController
from fallbackgate.controllers.timing import step_deadline_s
from fallbackgate.engine.controller import ExpertMiss, KVBlockInfo
from fallbackgate.engine.device_pool import TierPool
from fallbackgate.engine.hardware import CPU_BOX
from fallbackgate.engine.kv.block import SpillMode
from fallbackgate.engine.kv.spill import SpillDir
from fallbackgate.engine.kv.store import KVStore
from fallbackgate.engine.messages import StepKind, StepPlan
from fallbackgate.engine.static_view import StaticView
from fallbackgate.engine.step_context import StepUses
from fallbackgate.engine.tags import ObjectKind, Tag, Tier
from fallbackgate.policy.schema import SLO, ControllerSpec, Policy, QualityBudget, RequestClass

EXPERT_BYTES, BLOCK_BYTES = 1 << 20, 1 << 13
LIMITS = {"max_mean_kl": 1.0, "max_p99_kl": 1.0, "max_approx_fraction": 1.0, "min_top1_agreement": 0.0}


def _policy(step_time: str, tags: list[str]) -> Policy:
    budget = QualityBudget(allowed_tags=tags, **LIMITS)
    return Policy(
        controller=ControllerSpec(step_time=step_time),
        classes={"c": RequestClass(slo=SLO(tpot_ms=20.0, ttft_ms=2000.0), budget=budget)},
        default_class="c",
    )


def _plan(num_tokens: int = 1) -> StepPlan:
    return StepPlan(1, StepKind.DECODE, ["r"], {"r": num_tokens}, {"r": 40})


def _view(measured_s: float, **fields: object) -> StaticView:
    base: dict = dict(
        profile=CPU_BOX, request_classes={"r": "c"}, running_ids=("r",), num_layers=4, bytes_per_expert=EXPERT_BYTES,
        num_expert_params=EXPERT_BYTES // 4, bytes_per_kv_block=BLOCK_BYTES, is_ram_tiered=True,
        measured_compute_s=measured_s, quantized_copy_bytes={(ObjectKind.EXPERT, 8): EXPERT_BYTES // 4},
    )  # fmt: skip
    return StaticView(**{**base, **fields})


def test_a_measured_step_time_shortens_the_deadline_and_a_modeled_one_ignores_it() -> None:
    modeled, measured = _policy("modeled", []), _policy("measured", [])
    dense = CPU_BOX.dense_step_s(4, 0.0)
    assert step_deadline_s(modeled, _plan(), _view(0.015)) == pytest.approx(0.020 - dense)
    assert step_deadline_s(measured, _plan(), _view(0.015)) == pytest.approx(0.005)
    assert step_deadline_s(measured, _plan(), _view(0.025)) == 0.0  # the target is gone before any load
    assert step_deadline_s(measured, _plan(), _view(0.0)) == pytest.approx(0.020 - dense)  # nothing measured yet
    assert step_deadline_s(measured, _plan(num_tokens=8), _view(0.015)) == pytest.approx(2.0 - 0.015)  # prefill


def test_the_engine_folds_decode_steps_into_a_decaying_mean_of_compute_less_exposed_reads() -> None:
    uses = StepUses()
    uses.note_decode_step(0.030, 0.010)
    assert uses.measured_compute_s == pytest.approx(0.020)  # the first step sets it
    uses.note_decode_step(0.010, 0.0)
    assert uses.measured_compute_s == pytest.approx(0.020 + 0.3 * (0.010 - 0.020))
    uses.note_decode_step(0.001, 0.005)  # reads longer than the wall clock count as no compute, not less
    assert uses.measured_compute_s == pytest.approx(0.017 + 0.3 * (0.0 - 0.017))
    uses.clear()  # the step's uses are cleared at step end; the measurement is kept
    assert uses.measured_compute_s > 0


def _miss(view: StaticView, lowbit_disk_bytes: int = 0) -> ExpertMiss:
    return ExpertMiss(
        step_id=1, request_id="r", request_class="c", layer=0, expert_id=1, num_tokens=1, max_gate_weight=0.3,
        home=Tier.DISK, num_bytes=EXPERT_BYTES, is_lowbit_available=True, is_device_room=False, dtype="float32",
        is_cpu_execute_offered=False, lowbit_disk_bytes=lowbit_disk_bytes,
    )  # fmt: skip


@pytest.mark.parametrize("step_time, tag", [("modeled", Tag.EXACT_LOAD), ("measured", Tag.EXPERT_LOWBIT)])
def test_a_low_bit_copy_is_chosen_when_it_arrives_sooner_than_a_late_exact_load(step_time: str, tag: Tag) -> None:
    view = _view(0.025)  # measured compute past the 20 ms target: every read is late, the low-bit one by less
    joint = JointController(_policy(step_time, ["expert_lowbit"]))
    joint.on_step_start(_plan(), view)
    decision = joint.expert_action(_miss(view))
    assert decision.tag is tag
    if tag is Tag.EXPERT_LOWBIT:
        (row,) = joint.take_arbitrations()
        options = {o.tag: o for o in row.options}
        assert not options[Tag.EXACT_LOAD].is_feasible and options[Tag.EXPERT_LOWBIT].is_feasible
        assert options[Tag.EXPERT_LOWBIT].predicted_s < options[Tag.EXACT_LOAD].predicted_s


@pytest.mark.parametrize(
    "disk_bytes, tag",
    [(0, Tag.EXPERT_LOWBIT), (EXPERT_BYTES // 4, Tag.EXPERT_LOWBIT), (EXPERT_BYTES, Tag.EXACT_LOAD)],
    ids=["kept in RAM", "persisted on disk", "made from the checkpoint"],
)
def test_a_low_bit_copy_that_must_first_read_the_whole_expert_is_not_a_fallback(disk_bytes: int, tag: Tag) -> None:
    """On the RAM/disk layout a low-bit copy not kept in RAM is read from disk first: a persisted one still
    arrives before the late exact load (a quarter of its bytes), one made from the checkpoint reads the whole
    expert, so the exact load (slipping) is the better choice and the arbitration says why."""
    view = _view(0.025)
    joint = JointController(_policy("measured", ["expert_lowbit"]))
    joint.on_step_start(_plan(), view)
    weighed_s = joint.link.legs(disk_bytes, Tier.DISK).get(Tier.DISK, 0.0)  # the read, priced before it is queued
    assert joint.expert_action(_miss(view, disk_bytes)).tag is tag
    (row,) = joint.take_arbitrations()
    options = {o.tag: o for o in row.options}
    if disk_bytes == EXPERT_BYTES:
        assert Tag.EXPERT_LOWBIT not in options  # not offered: no sooner than the exact load it would replace
    else:
        exact, lowbit = options[Tag.EXACT_LOAD].predicted_s, options[Tag.EXPERT_LOWBIT].predicted_s
        assert lowbit < exact and (lowbit == 0.0) == (disk_bytes == 0)
        assert lowbit == weighed_s  # the ledger's prediction is the one weighed, not one priced after booking


def test_a_low_bit_copy_two_requests_need_in_one_step_is_read_once() -> None:
    """The engine makes one low-bit copy per expert and step: a second request's low-bit miss of the same
    expert books no second disk read (its option is free), as a second exact load books none."""
    view = _view(0.025, request_classes={"r": "c", "s": "c"}, running_ids=("r", "s"))
    joint = JointController(_policy("measured", ["expert_lowbit"]))
    joint.on_step_start(StepPlan(1, StepKind.DECODE, ["r", "s"], {"r": 1, "s": 1}, {"r": 40, "s": 40}), view)
    first = joint.expert_action(_miss(view, EXPERT_BYTES // 4))
    left, queued = dict(joint.link.left_s), joint.link.num_disk_queued
    second = joint.expert_action(dataclasses.replace(_miss(view, EXPERT_BYTES // 4), request_id="s"))
    assert first.tag is second.tag is Tag.EXPERT_LOWBIT
    assert joint.link.left_s == left and joint.link.num_disk_queued == queued == 1
    booked, shared = ({o.tag: o for o in row.options} for row in joint.take_arbitrations())
    assert booked[Tag.EXPERT_LOWBIT].predicted_s > 0.0 == shared[Tag.EXPERT_LOWBIT].predicted_s


def test_a_late_kv_block_is_read_from_its_int8_copy_when_that_arrives_sooner() -> None:
    block = KVBlockInfo(("r", 0, 0), 16, Tier.DISK, Tier.DISK, 8, BLOCK_BYTES // 4)
    view = _view(0.025, kv_blocks=(block,), kv_tokens={"r": 40})
    joint = JointController(_policy("measured", ["kv_dequant"]))
    joint.on_step_start(_plan(), view)
    (row,) = joint.take_arbitrations()
    assert row.choice is Tag.KV_DEQUANT
    options = {o.tag: o for o in row.options}
    assert options[Tag.KV_DEQUANT].predicted_s < options[Tag.EXACT_LOAD].predicted_s


def test_a_cpu_spill_of_both_copies_writes_a_full_and_an_int8_copy_to_disk(tmp_path: pathlib.Path) -> None:
    device, host = TierPool("device", 1 << 20), TierPool("host", 0)
    kv = KVStore(1, 1, 2, 2, 4, device, host, SpillDir(tmp_path), torch.device("cpu"))
    kv.add_sequence("r")
    kv.append("r", 4)
    kv.write("r", 0, 0, torch.randn(1, 4, 2), torch.randn(1, 4, 2))
    block = kv.blocks("r", 0)[0]
    written = kv.spill_block(block, SpillMode.DISK_FULL_AND_INT8)
    assert block.device is None and block.disk is not None and block.disk_q is not None
    assert written == kv.bytes_per_block + block.disk_q.num_bytes
    assert host.used_bytes == 0  # nothing in RAM outside the device pool

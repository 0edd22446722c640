"""``controller.expert_admission: lowbit_colder``: the joint controller serves an in-time expert miss from its
low-bit copy (taking no room, evicting nothing) only when the expert is colder than the first expert its exact
copy would evict, the request's class allows ``expert_lowbit`` and its budget holds the cost."""

from __future__ import annotations

import dataclasses

import pytest

from fallbackgate.controllers import make_controller
from fallbackgate.engine.controller import ExpertMiss
from fallbackgate.engine.hardware import CPU_BOX
from fallbackgate.engine.messages import StepKind, StepPlan
from fallbackgate.engine.tags import ObjectKind, Tag, Tier
from fallbackgate.policy.schema import SLO, ControllerSpec, ExpertAdmission, Policy, QualityBudget, RequestClass
from tests.test_controllers import EXPERT_BYTES, QUANT_BYTES, TOP_K, fake_view

OPEN = QualityBudget(
    max_mean_kl=1.0, max_p99_kl=2.0, max_approx_fraction=1.0, allowed_tags=["expert_lowbit"], min_top1_agreement=0
)
RESIDENT = tuple((1, e) for e in range(4))  # a full device: four warm experts of layer 1


def _decide(
    admission: ExpertAdmission,
    budget: QualityBudget,
    miss_freq: float,
    free_experts: int = 0,
    disk_bytes: int = 0,
    num_misses: int = 1,
    num_tokens: int = 1,
) -> list[Tag]:
    """The tags of `num_misses` cold misses of layer 0 in one step (expert 7, then 6, ...) of a request running
    `num_tokens` tokens (more than one: a prefill chunk)."""
    policy = Policy(
        controller=ControllerSpec(expert_admission=admission),
        classes={"c": RequestClass(slo=SLO(tpot_ms=1e6), budget=budget)},
        default_class="c",
    )
    controller = make_controller("joint", policy, top_k=TOP_K)
    controller.values.set_frequencies({**{k: 0.5 for k in RESIDENT}, **{(0, 7 - i): miss_freq for i in range(3)}})
    view = dataclasses.replace(
        fake_view(CPU_BOX, {"r": "c"}, ["r"]),
        device_budget_bytes=(len(RESIDENT) + free_experts) * EXPERT_BYTES,
        device_free_bytes=free_experts * EXPERT_BYTES,
        device_bytes_by_kind={ObjectKind.EXPERT: len(RESIDENT) * EXPERT_BYTES},
        on_device_experts=RESIDENT,
        num_layers=2,
        num_expert_layers=2,
        quantized_copy_bytes=QUANT_BYTES,
    )
    kind = StepKind.DECODE if num_tokens == 1 else StepKind.PREFILL
    controller.on_step_start(StepPlan(1, kind, ["r"], {"r": num_tokens}, {"r": 8}), view)
    misses = [
        ExpertMiss(1, "r", "c", 0, 7 - i, 1, 0.3, Tier.HOST, EXPERT_BYTES, True, free_experts > i, "", True, disk_bytes)
        for i in range(num_misses)
    ]
    return [controller.expert_action(dataclasses.replace(m, layer_expert_ids=(7, 6, 5))).tag for m in misses]


def test_a_colder_in_time_miss_is_served_low_bit_only_under_lowbit_colder() -> None:
    assert _decide(ExpertAdmission.LOWBIT_COLDER, OPEN, miss_freq=0.01) == [Tag.EXPERT_LOWBIT]
    assert _decide(ExpertAdmission.EXACT, OPEN, miss_freq=0.01) == [Tag.EXACT_LOAD]


def test_lowbit_colder_decode_admits_in_decode_steps_only() -> None:
    """A prefill chunk loads the exact copy (its tokens share one grouped load); a decode step is admitted."""
    decode_only, anywhere = ExpertAdmission.LOWBIT_COLDER_DECODE, ExpertAdmission.LOWBIT_COLDER
    assert _decide(decode_only, OPEN, miss_freq=0.01) == [Tag.EXPERT_LOWBIT]
    assert _decide(decode_only, OPEN, miss_freq=0.01, num_tokens=8) == [Tag.EXACT_LOAD]
    assert _decide(anywhere, OPEN, miss_freq=0.01, num_tokens=8) == [Tag.EXPERT_LOWBIT]


def test_room_booked_by_the_layers_earlier_loads_is_not_room() -> None:
    """One free slot: the layer's first miss takes it, the second (as cold) is admitted low-bit."""
    tags = _decide(ExpertAdmission.LOWBIT_COLDER, OPEN, miss_freq=0.01, free_experts=1, num_misses=2)
    assert tags == [Tag.EXACT_LOAD, Tag.EXPERT_LOWBIT]


@pytest.mark.parametrize(
    ("budget", "miss_freq", "free_experts"),
    [
        (OPEN, 0.9, 0),  # warmer than every resident expert: worth its room
        (OPEN, 0.01, 1),  # room without evicting anything
        (OPEN.model_copy(update={"allowed_tags": []}), 0.01, 0),  # the class does not allow low-bit experts
        (OPEN.model_copy(update={"max_mean_kl": 0.0, "max_p99_kl": 0.0}), 0.01, 0),  # no quality budget left
    ],
)
def test_the_exact_copy_is_loaded_when_warmer_with_room_or_outside_the_budget(budget, miss_freq, free_experts) -> None:
    assert _decide(ExpertAdmission.LOWBIT_COLDER, budget, miss_freq, free_experts) == [Tag.EXACT_LOAD]


def test_a_copy_that_must_be_made_from_the_whole_expert_is_not_admitted() -> None:
    """With no low-bit copy kept or persisted, making one reads the whole expert: no byte saved."""
    tags = _decide(ExpertAdmission.LOWBIT_COLDER, OPEN, miss_freq=0.01, disk_bytes=EXPERT_BYTES)
    assert tags == [Tag.EXACT_LOAD]

"""The joint controller in the RAM-and-disk regime: KV priced at the disk read it would cost, full copies when
a spill goes to the disk, a rebuild priced with the expert loads it needs, and room flowing back from cold
KV to the experts a step used and lost (without it KV kept every byte it once won: measured on the mixed
workload at 0.25 of demand, 3 experts resident beside 90 kept prefixes for the last 70 steps)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from fallbackgate.controllers import JointController
from fallbackgate.controllers.arbitration import recompute_s
from fallbackgate.controllers.joint_memory import demotions, rebalance
from fallbackgate.engine.controller import KVBlockInfo, Victim
from fallbackgate.engine.hardware import CPU_BOX
from fallbackgate.engine.kv.block import SpillMode
from fallbackgate.engine.kv.prefix_types import PrefixEntryInfo
from fallbackgate.engine.static_view import StaticView
from fallbackgate.engine.tags import ObjectKind, Tier
from fallbackgate.policy.schema import SLO, Policy, QualityBudget, RequestClass

EXPERT_BYTES, BLOCK_BYTES, LAYERS, EXPERTS = 1 << 18, 1 << 13, 2, 4
LIMITS = {"max_mean_kl": 1.0, "max_p99_kl": 1.0, "max_approx_fraction": 1.0, "min_top1_agreement": 0.0}
POLICY = Policy(
    classes={
        "quant": RequestClass(
            slo=SLO(tpot_ms=50.0), budget=QualityBudget(allowed_tags=["kv_dequant", "recompute"], **LIMITS)
        )
    },
    default_class="quant",
)


def _view(is_ram_tiered: bool = True, **fields: object) -> StaticView:
    base: dict = dict(
        profile=CPU_BOX, bytes_per_expert=EXPERT_BYTES, bytes_per_kv_block=BLOCK_BYTES, num_layers=LAYERS,
        num_experts=EXPERTS, num_expert_params=EXPERT_BYTES // 4, is_ram_tiered=is_ram_tiered,
        request_classes={"run": "quant", "kept": "quant"}, quantized_copy_bytes={(ObjectKind.KV_BLOCK, 8): 2304},
    )  # fmt: skip
    return StaticView(**{**base, **fields})


def _blocks(request_id: str, num_blocks: int) -> tuple[KVBlockInfo, ...]:
    return tuple(
        KVBlockInfo((request_id, layer, i), 16, Tier.DEVICE, None) for layer in range(LAYERS) for i in range(num_blocks)
    )


def test_a_rebuild_is_priced_with_the_expert_loads_it_needs_where_experts_are_off_device() -> None:
    all_on = _view(device_bytes_by_kind={ObjectKind.EXPERT: LAYERS * EXPERTS * EXPERT_BYTES})
    none_on = _view()
    half_on = _view(device_bytes_by_kind={ObjectKind.EXPERT: LAYERS * EXPERTS * EXPERT_BYTES // 2})
    tokens, top_k = 32, 2
    uses = min(EXPERTS, tokens * top_k)
    load_s = CPU_BOX.transfer_s(EXPERT_BYTES, Tier.DISK)
    exact = recompute_s(CPU_BOX, all_on, tokens, top_k)
    assert recompute_s(CPU_BOX, none_on, tokens, top_k) - exact == pytest.approx(LAYERS * uses * load_s)
    assert recompute_s(CPU_BOX, half_on, tokens, top_k) - exact == pytest.approx(LAYERS * uses * load_s / 2)


def test_kv_is_priced_at_the_tier_a_spill_goes_to_and_spills_keep_a_full_copy_on_a_cpu() -> None:
    joint = JointController(POLICY)
    joint._budget("run", "quant")  # the request's budget, as on_step_start opens it
    running = {"run"}
    cases = ((True, Tier.DISK, SpillMode.DISK_FULL_AND_INT8), (False, Tier.HOST, SpillMode.HOST_INT8))
    for is_ram, tier, mode in cases:
        view = _view(is_ram, running_ids=("run",))
        value = joint.values.kv_value(("run", 0, 0), view, running)
        assert value == CPU_BOX.transfer_s(BLOCK_BYTES, tier) / BLOCK_BYTES
        assert joint.spill_mode("run", view) is mode  # int8 alone only where a full copy stays in reach
    joint.book.requests["run"].spent = 1e9  # nothing approximate fits any more
    assert joint.spill_mode("run", _view(True, running_ids=("run",))) is SpillMode.DISK_FULL  # no int8 to read


def _room_state(idle_steps: int, num_free: int = 0) -> tuple[JointController, StaticView]:
    """A step that used expert (0, 1) and ended without it, a running request's blocks and one kept prefix."""
    joint = JointController(POLICY)
    joint.values.set_frequencies({(0, 0): 0.9, (0, 1): 0.9})
    prefix = PrefixEntryInfo("ab" * 16, 0, idle_steps, LAYERS)
    blocks = _blocks("run", 40) + _blocks("kept", 20)
    view = _view(
        running_ids=("run",), used_expert_keys=((0, 0), (0, 1)), on_device_experts=((0, 0),),
        kv_blocks=blocks, prefix_entries={"kept": prefix}, device_free_bytes=num_free * BLOCK_BYTES,
        device_budget_bytes=EXPERT_BYTES + len(blocks) * BLOCK_BYTES + num_free * BLOCK_BYTES,
        device_bytes_by_kind={ObjectKind.EXPERT: EXPERT_BYTES, ObjectKind.KV_BLOCK: len(blocks) * BLOCK_BYTES},
        expert_homes={(0, 0): Tier.DISK, (0, 1): Tier.DISK},
    )  # fmt: skip
    return joint, view


def test_an_expert_the_step_lost_gets_its_room_back_from_a_cold_prefix_never_from_running_kv() -> None:
    joint, view = _room_state(idle_steps=200, num_free=4)
    actions = joint.on_step_end(view)
    spilled = [key for key, _ in actions.spill]
    needed = EXPERT_BYTES // BLOCK_BYTES - 4  # one expert's bytes less the free room
    assert len(spilled) == needed and {key[0] for key in spilled} == {"kept"}
    assert all(mode is SpillMode.HOST_FULL for _, mode in actions.spill)  # a kept prefix stays reusable on disk


def test_no_room_moves_when_the_prefix_is_hot_or_no_expert_was_lost() -> None:
    joint, view = _room_state(idle_steps=0)  # just kept: worth more per byte than the expert
    assert joint.on_step_end(view).spill == []
    joint, view = _room_state(idle_steps=200)
    view = dataclasses.replace(view, on_device_experts=((0, 0), (0, 1)))
    assert joint.on_step_end(view).spill == []  # every used expert still on device


def test_the_step_end_walks_no_victims_where_free_room_already_serves() -> None:
    """rebalance walks the experts only for a promotion short of room, demotions the KV only for an expert
    the free room cannot take back (stop 47: the two walks were most of the step end's 0.2 ms)."""
    joint, view = _room_state(idle_steps=200, num_free=EXPERT_BYTES // BLOCK_BYTES)  # one expert's room is free

    def untouched() -> Iterator[tuple[float, Victim]]:
        raise AssertionError("walked")
        yield  # a generator: raises only when asked for a victim

    actions = rebalance(view, joint.values, 0.0, 1)
    demotions(view, joint.values, untouched(), actions)
    assert actions.spill == [] and actions.evict_experts == []
    joint, view = _room_state(idle_steps=200, num_free=4)  # short of one expert's room: the KV is walked
    with pytest.raises(AssertionError, match="walked"):
        demotions(view, joint.values, untouched(), rebalance(view, joint.values, 0.0, 1))

"""The controllers' lazy selections choose the same victims in the same order as the full rebuild-and-sort
they replaced (kept in :mod:`fallbackgate.bench.victims_reference`), on randomized device states with ties,
pinned objects, idle requests and recency; and the KV store's maintained off-device index and lazy walks
agree with full walks of its tables through appends, spills, promotions and frees."""

from __future__ import annotations

import itertools
import json
import pathlib
import random

import pytest
import torch

from fallbackgate.bench import victims_reference as ref
from fallbackgate.controllers import (
    ExactLRUController,
    IndependentLRUController,
    JointController,
    StaticSplitController,
)
from fallbackgate.controllers.joint_memory import rebalance
from fallbackgate.engine.controller import KVBlockInfo
from fallbackgate.engine.device_pool import TierPool
from fallbackgate.engine.hardware import CPU_BOX
from fallbackgate.engine.kv.block import RequestBlockKeys, SpillMode
from fallbackgate.engine.kv.spill import SpillDir
from fallbackgate.engine.kv.store import KVStore
from fallbackgate.engine.static_view import StaticView
from fallbackgate.engine.tags import ObjectKind, Tag, Tier
from fallbackgate.policy.schema import SLO, Policy, QualityBudget, RequestClass

EXPERT_BYTES, BLOCK_BYTES = 1 << 20, 1 << 16
LIMITS = {"max_mean_kl": 1.0, "max_p99_kl": 1.0, "max_approx_fraction": 1.0, "min_top1_agreement": 0.0}
POLICY = Policy(
    classes={
        "quant": RequestClass(
            slo=SLO(tpot_ms=50.0), budget=QualityBudget(allowed_tags=["kv_dequant", "recompute"], **LIMITS)
        ),
        "exact": RequestClass(slo=SLO(tpot_ms=50.0), budget=QualityBudget(allowed_tags=[], **LIMITS)),
    },
    default_class="exact",
)


def _random_state(rng: random.Random) -> tuple[StaticView, dict, list, list]:
    """A view with random residency, homes, tied and distinct frequencies, idle and running requests."""
    num_layers, num_experts = rng.randint(1, 4), rng.randint(1, 8)
    experts = [(layer, e) for layer in range(num_layers) for e in range(num_experts)]
    on_device = tuple(k for k in experts if rng.random() < 0.7)
    homes = {k: rng.choice([Tier.HOST, Tier.DISK]) for k in experts}
    freq = {k: rng.choice([0.1, 0.1, 0.3, 0.5, rng.random(), 0.95, 0.95]) for k in experts if rng.random() < 0.7}
    rids = [f"r{i}" for i in range(rng.randint(1, 5))]
    blocks = []
    for rid in rids:  # the engine's order: request, then layer, then index
        num_blocks = rng.randint(0, 6)
        for layer in range(num_layers):
            for index in range(num_blocks):
                is_on = rng.random() < 0.75
                exact = Tier.DEVICE if is_on else rng.choice([Tier.HOST, Tier.DISK, None])
                quant = rng.choice([Tier.HOST, None]) if not is_on else None
                blocks.append(KVBlockInfo((rid, layer, index), 16, exact, quant, 8 if quant else 0))
    used_kv = [b.key for b in blocks if rng.random() < 0.2]
    rng.shuffle(used_kv)
    used_experts = [k for k in experts if rng.random() < 0.3]
    rng.shuffle(used_experts)
    num_kv_device = sum(b.is_on_device for b in blocks)
    view = StaticView(
        CPU_BOX,
        request_classes={r: rng.choice(["quant", "exact"]) for r in rids},
        running_ids=tuple(r for r in rids if rng.random() < 0.6),
        used_expert_keys=tuple(used_experts),
        used_kv_block_keys=tuple(used_kv),
        staged_kv_tags={k: rng.choice([Tag.EXACT_LOAD, Tag.KV_DEQUANT]) for k in used_kv},
        device_budget_bytes=(len(on_device) + num_kv_device) * EXPERT_BYTES,
        device_free_bytes=rng.choice([0, BLOCK_BYTES, EXPERT_BYTES * 2]),
        device_bytes_by_kind={
            ObjectKind.EXPERT: len(on_device) * EXPERT_BYTES,
            ObjectKind.KV_BLOCK: num_kv_device * BLOCK_BYTES,
        },
        bytes_per_expert=EXPERT_BYTES,
        num_experts=num_experts,
        on_device_experts=on_device,
        expert_homes=homes,
        num_layers=num_layers,
        bytes_per_kv_block=BLOCK_BYTES,
        kv_blocks=tuple(blocks),
        quantized_copy_bytes={(ObjectKind.KV_BLOCK, 8): BLOCK_BYTES // 3, (ObjectKind.KV_BLOCK, 4): BLOCK_BYTES // 6},
    )
    pinned_e = {k for k in on_device if rng.random() < 0.2}
    pinned_kv = {b.key for b in blocks if rng.random() < 0.2}
    if rng.random() < 0.5 and rids:  # a whole request pinned, as the step's requests are
        pinned_kv |= {b.key for b in blocks if b.key[0] == rids[0]}
    return view, freq, list(pinned_e), list(pinned_kv)


def _recency(controller, view: StaticView, rng: random.Random) -> None:
    """Random recency of several past steps' uses."""
    for _ in range(rng.randint(0, 3)):
        keys = list(view.used_expert_keys)
        rng.shuffle(keys)
        kv = list(view.used_kv_block_keys)
        rng.shuffle(kv)
        controller.recency.touch(StaticView(CPU_BOX, used_expert_keys=tuple(keys), used_kv_block_keys=tuple(kv)))


@pytest.mark.parametrize("seed", range(300))
def test_lazy_victims_are_the_full_sort_in_the_same_order(seed: int) -> None:
    rng = random.Random(seed)
    view, freq, pinned_e, pinned_kv = _random_state(rng)
    pe, pk = set(pinned_e), set(pinned_kv)
    joint = JointController(POLICY, top_k=rng.randint(1, 2))
    joint.values.set_frequencies(freq)
    joint.current_layer = rng.randint(-1, view.num_layers - 1)  # the layer of the step's last miss
    for rid in view.request_classes:
        if rng.random() < 0.7:  # requests the budget book knows: their spill mode follows their class
            joint._budget(rid, view.request_class(rid))
    assert list(joint.choose_victims(1, view, pe, pk)) == ref.joint_victims(joint, view, pe, pk)
    lru = ExactLRUController(force=rng.choice([(), ("kv_dequant",), ("recompute",)]))
    independent, split = IndependentLRUController(), StaticSplitController(rng.choice([0.2, 0.5, 0.8]))
    for controller in (lru, independent, split):
        _recency(controller, view, rng)
    assert list(lru.choose_victims(1, view, pe, pk)) == ref.exact_lru_victims(
        lru.recency, lru.kv_spill_mode, view, pe, pk
    )
    assert list(independent.choose_victims(1, view, pe, pk)) == ref.independent_lru_victims(
        independent.recency, view, pe, pk
    )
    assert list(split.choose_victims(1, view, pe, pk)) == ref.static_split_victims(split, view, pe, pk)
    slack = rng.choice([0.0, 1.0])
    assert rebalance(view, joint.values, slack, joint.top_k) == ref.rebalance(view, joint.values, slack, joint.top_k)


class CountingView(StaticView):
    """A view that records, in `WALKED`, every device KV block its per-request walk hands out."""

    def device_kv_blocks_of(self, request_id: str, is_index_major: bool = False):
        for block in super().device_kv_blocks_of(request_id, is_index_major):
            WALKED.append(block.key)
            yield block


WALKED: list = []


def test_taking_k_victims_walks_about_k_blocks() -> None:
    """With a long request on device, the first victims come without walking its other blocks."""
    walked = WALKED

    class NoFullWalkView(CountingView):
        def device_kv_blocks(self):  # the full walk the lazy selections must not make
            raise AssertionError("device_kv_blocks walked")

    blocks = tuple(KVBlockInfo(("idle", layer, i), 16, Tier.DEVICE, None) for layer in range(4) for i in range(500))
    view = NoFullWalkView(
        CPU_BOX, running_ids=(), kv_blocks=blocks, num_layers=4, bytes_per_kv_block=BLOCK_BYTES,
        quantized_copy_bytes={(ObjectKind.KV_BLOCK, 8): BLOCK_BYTES // 3},
    )  # fmt: skip
    for controller in (JointController(POLICY), ExactLRUController(), IndependentLRUController()):
        walked.clear()
        first = list(itertools.islice(controller.choose_victims(1, view, set(), set()), 5))
        assert len(first) == 5 and all(v.kv_block_key is not None for v in first)
        assert len(walked) <= 6  # a heap merge reads one ahead


def test_requests_pinned_whole_are_not_walked_by_the_victim_orders() -> None:
    """An expert miss (KV not evictable: every request pinned whole) or a step's own requests: the joint
    order reads none of those requests' blocks (it walked every one on every miss, a third of a mixed
    sweep run's wall time), nor do the baselines' when every request is pinned; the victims are the full
    sort's."""
    walked = WALKED
    blocks = tuple(KVBlockInfo((rid, layer, i), 16, Tier.DEVICE, None) for rid in ("a", "b")
                   for layer in range(4) for i in range(200))  # fmt: skip
    experts = tuple((0, e) for e in range(6))
    view = CountingView(
        CPU_BOX, running_ids=("a", "b"), kv_blocks=blocks, num_layers=4, bytes_per_kv_block=BLOCK_BYTES,
        on_device_experts=experts, expert_homes=dict.fromkeys(experts, Tier.DISK), num_experts=6,
        bytes_per_expert=EXPERT_BYTES, quantized_copy_bytes={(ObjectKind.KV_BLOCK, 8): BLOCK_BYTES // 3},
    )  # fmt: skip
    joint = JointController(POLICY)
    for pinned, walked_requests in ((RequestBlockKeys(frozenset({"a", "b"})), set()),
                                    (RequestBlockKeys(frozenset({"a"})), {"b"})):  # fmt: skip
        walked.clear()
        victims = list(joint.choose_victims(1, view, set(), pinned))
        assert {key[0] for key in walked} == walked_requests
        assert victims == ref.joint_victims(joint, view, set(), pinned)
        assert sum(v.expert_key is not None for v in victims) == len(experts)
    everything = RequestBlockKeys(frozenset({"a", "b"}))
    lru, independent, split = ExactLRUController(), IndependentLRUController(), StaticSplitController(0.5)
    for controller, expected in (
        (lru, ref.exact_lru_victims(lru.recency, lru.kv_spill_mode, view, set(), everything)),
        (independent, ref.independent_lru_victims(independent.recency, view, set(), everything)),
        (split, ref.static_split_victims(split, view, set(), everything)),
    ):  # the baselines too: an expert miss walks no KV block
        walked.clear()
        assert list(controller.choose_victims(1, view, set(), everything)) == expected
        assert walked == [] and len(expected) == len(experts)


def _kv_store(tmp_path: pathlib.Path) -> KVStore:
    return KVStore(
        3, 1, 2, 2, 4, TierPool("device", 10**6), TierPool("host", 10**6), SpillDir(tmp_path), torch.device("cpu")
    )


def _check_index(kv: KVStore) -> None:
    for rid in kv.tables:
        for num_blocks in (0, 1, 3, 100):
            assert kv.off_device_blocks(rid, num_blocks) == ref.off_device_walk(kv, rid, num_blocks)
    assert [b for rid in kv.tables for b in kv.device_blocks_of(rid)] == kv.device_blocks()
    for rid in kv.tables:
        by_index = sorted(kv.device_blocks_of(rid), key=lambda b: (b.key[2], b.key[1]))
        assert list(kv.device_blocks_of(rid, is_index_major=True)) == by_index


@pytest.mark.parametrize("seed", range(20))
def test_the_off_device_index_follows_every_change(tmp_path: pathlib.Path, seed: int) -> None:
    rng, kv = random.Random(seed), _kv_store(tmp_path)
    for step in range(40):
        op = rng.random()
        if op < 0.25 or not kv.tables:
            rid = f"r{step}"
            kv.add_sequence(rid)
            kv.append(rid, rng.randint(1, 20))
        elif op < 0.45:
            kv.append(rng.choice(list(kv.tables)), rng.randint(1, 6))  # brings an off-device tail back
        elif op < 0.8 and kv.device_blocks():
            block = rng.choice(kv.device_blocks())
            kv.spill_block(block, rng.choice([SpillMode.HOST_FULL, SpillMode.DROP, SpillMode.HOST_INT8]))
        elif op < 0.9:
            off = [b for rid in kv.tables for b in kv.off_device_blocks(rid, 100) if b.has_exact_copy]
            if off:
                block = rng.choice(off)
                kv.stage(block, Tag.EXACT_LOAD)
                assert kv.promote(block)
        else:
            kv.free_sequence(rng.choice(list(kv.tables)))
        _check_index(kv)
    kv.clear_scratch()


def test_a_lazy_walk_survives_spilling_what_it_yielded(tmp_path: pathlib.Path) -> None:
    """The engine spills each victim as it takes it: the walk still yields every block it listed before."""
    kv = _kv_store(tmp_path)
    kv.add_sequence("r")
    kv.append("r", 30)
    before = list(kv.device_blocks_of("r"))
    taken = []
    for block in kv.device_blocks_of("r"):
        taken.append(block)
        kv.spill_block(block, SpillMode.DROP)
    assert taken == before and kv.device_blocks() == []
    assert kv.off_device_blocks("r", 100) == ref.off_device_walk(kv, "r", 100)


def test_the_cost_benchmark_runs_and_compares_old_and_new(tmp_path: pathlib.Path) -> None:
    """The smallest size of `bench.controller_cost`: every row timed, the selections checked equal inside."""
    from fallbackgate.bench import controller_cost

    out = tmp_path / "cost.json"
    assert controller_cost.main(["--json", str(out), "--sizes", "1k", "--reps", "1"]) == 0
    (result,) = json.loads(out.read_text())["results"]
    assert result["num_objects"] == result["num_device_experts"] + result["num_device_kv_blocks"] > 500
    assert set(result["choose_victims"]) == {"joint", "exact_lru", "independent_lru", "static_split"}
    for row in result["choose_victims"].values():
        assert row["old_s"] > 0 and row["new_k8_s"] > 0 and row["ratio_k8"] == row["old_s"] / row["new_k8_s"]
    assert set(result["per_step"]) == {"step_pin", "runner_kv_walk", "joint_kv_queue", "joint_rebalance"}
    assert set(result["experts"]) == {"expert_victims_after_miss", "joint_step_values", "copy_sample"}
    for row in result["experts"].values():  # each row checked its new result against the old inside the run
        assert row["old_s"] > 0 and row["new_s"] > 0 and row["ratio"] == row["old_s"] / row["new_s"]

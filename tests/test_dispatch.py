"""Batched expert dispatch: one grouped kernel over the slot pool, whatever the budget.

- routing grouped once per layer: resident uses counted per (expert, request), misses listed per
  (expert, request) with their rows and top gate weight;
- the kernel's output for an expert does not depend on which slot it sits in or what else the call holds;
- in bf16 on every architecture, batched greedy tokens and logits are bitwise equal with no budget and
  with budgets that make >= 20 % of expert uses exact_load (one of them too small for a layer's working
  set, so its rows are computed in several kernel calls), under an identical schedule.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch

from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.experts.grouped import grouped_rows, single_expert_rows, stacked_forward, sum_rows
from fallbackgate.engine.experts.routing import group_layer, row_owner
from fallbackgate.engine.experts.weights import ExpertWeights
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.engine.tags import Tag
from tests.checkpoints import ARCHITECTURES, make_checkpoint

PROMPTS = ([5, 17, 33, 9, 101, 250, 7, 64, 12, 3, 88], [44, 2, 190, 31, 6], [9, 9, 120, 77, 3, 41, 15])
NEW_TOKENS = 8


class _Gated(torch.nn.Module):
    """The part of a transformers experts module the kernel calls: its gate."""

    def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up_out.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up


def test_group_layer_counts_resident_uses_and_lists_misses_per_expert_and_request() -> None:
    top_k_index = torch.tensor([[0, 3], [3, 1], [0, 1], [2, 3]])  # tokens 0-1: request 0; 2-3: request 1
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5], [0.9, 0.1]])
    table = torch.tensor([5, -1, 7, -1])  # experts 0 and 2 on device; 1 and 3 missing
    routing = group_layer(top_k_index, weights, table, row_owner([0, 0, 1, 1], 2), 2)
    assert routing.resident_uses.tolist() == [1, 2]  # request 0: expert 0; request 1: experts 0 and 2
    assert routing.used_experts.tolist() == [0, 1, 2, 3]
    misses = [(m.expert_id, m.request_index, m.rows.tolist(), m.top_weight) for m in routing.misses]
    assert misses == [
        (1, 0, [3], pytest.approx(0.3)),
        (1, 1, [5], pytest.approx(0.5)),
        (3, 0, [1, 2], pytest.approx(0.7)),
        (3, 1, [7], pytest.approx(0.1)),
    ]


def test_a_small_all_resident_layer_groups_as_the_general_path_does(monkeypatch: pytest.MonkeyPatch) -> None:
    from fallbackgate.engine.experts import routing

    gen = torch.Generator().manual_seed(2)
    top_k_index, weights = torch.randint(0, 6, (5, 3), generator=gen), torch.rand(5, 3, generator=gen)
    table, owner = torch.tensor([4, 0, 9, 2, 7, 1]), row_owner([0, 0, 2, 1, 2], 3)
    small = group_layer(top_k_index, weights, table, owner, 3)
    monkeypatch.setattr(routing, "MAX_SMALL_ROWS", 0)
    general = group_layer(top_k_index, weights, table, owner, 3)
    assert small.used_experts.tolist() == general.used_experts.tolist() == sorted(set(top_k_index.ravel().tolist()))
    assert small.resident_uses.tolist() == general.resident_uses.tolist()
    assert small.misses == general.misses == []
    assert small.slots.tolist() == general.slots.tolist() == table[top_k_index.ravel()].tolist()


def test_an_experts_rows_do_not_depend_on_its_slot_or_its_neighbours() -> None:
    torch.manual_seed(0)
    module, hidden = _Gated(), torch.randn(6, 16, dtype=torch.bfloat16)
    experts = [
        ExpertWeights(torch.randn(32, 16, dtype=torch.bfloat16), torch.randn(16, 16, dtype=torch.bfloat16))
        for _ in range(3)
    ]
    index, weights = torch.tensor([[0, 1], [2, 0], [1, 2], [0, 2], [1, 0], [2, 1]]), torch.rand(6, 2)
    reference = stacked_forward(module, experts.__getitem__, 3, hidden, index, weights)
    one_per_group = experts[0].gate_up.nbytes + experts[0].down.nbytes  # three stacks of one expert each
    loaded: list[int] = []
    load = lambda i: loaded.append(i) or experts[i]  # noqa: E731
    grouped = stacked_forward(module, load, 3, hidden, index, weights, one_per_group)
    assert torch.equal(grouped, reference) and loaded == [0, 1, 2]
    pool_up, pool_down = torch.zeros(9, 32, 16, dtype=torch.bfloat16), torch.zeros(9, 16, 16, dtype=torch.bfloat16)
    slot_of = [7, 2, 4]  # the same experts scattered over a larger pool, among unused slots
    for expert, slot in zip(experts, slot_of, strict=True):
        pool_up[slot], pool_down[slot] = expert.gate_up, expert.down
    slots = torch.tensor(slot_of)[index].reshape(-1)
    rows = grouped_rows(module, pool_up, pool_down, hidden, slots, weights.reshape(-1), 2)
    assert torch.equal(sum_rows(rows, 6, 2, hidden.dtype), reference)
    partial = grouped_rows(
        module, pool_up, pool_down, hidden, torch.where(slots == 7, -1, slots), weights.reshape(-1), 2
    )
    assert torch.equal(partial[slots != 7], rows[slots != 7]) and not partial[slots == 7].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_host_sorted_path_gives_the_grouped_mm_rows_bitwise(dtype: torch.dtype) -> None:
    """A decode-sized call with its slots on the host takes one matmul per non-empty group; the rows equal the
    grouped_mm path's bit for bit, unused rows zero, for few groups and for more than the host path takes."""
    torch.manual_seed(1)
    module, num_slots = _Gated(), 12
    for inner in (32, 24):  # 24: the gate's rows end in a partial vector
        pool_up = torch.randn(num_slots, 2 * inner, 48, dtype=dtype)
        pool_down = torch.randn(num_slots, 48, inner, dtype=dtype)
        for num_tokens, top_k, num_used, is_partial in ((1, 2, 12, False), (1, 2, 2, True), (3, 2, 4, True),
                                                         (2, 3, 12, False), (5, 4, 12, True)):  # fmt: skip
            hidden = torch.randn(num_tokens, 48, dtype=dtype)
            slots = torch.randperm(num_used)[: num_tokens * top_k] if num_used >= num_tokens * top_k else None
            if slots is None:
                slots = torch.randint(0, num_used, (num_tokens * top_k,))
            slots = slots * (num_slots // num_used)
            if is_partial:
                slots[0] = -1  # a row computed elsewhere
            weights = torch.rand(num_tokens * top_k)
            on_device = grouped_rows(module, pool_up, pool_down, hidden, slots, weights, top_k)
            on_host = grouped_rows(module, pool_up, pool_down, hidden, slots, weights, top_k, slots.numpy())
            assert on_host.dtype == on_device.dtype and torch.equal(on_host, on_device)
            assert on_host[int(is_partial) :].abs().sum() > 0 and not (is_partial and on_host[0].any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_expert_on_the_cpu_gives_the_grouped_kernel_rows_bitwise(dtype: torch.dtype) -> None:
    """cpu_execute and expert_lowbit compute one expert's rows without the kernel's sort and scatter; the rows
    equal a one-slot stack through the grouped kernel bit for bit, for one row to a prefill's many, with the
    weights in fp32 as routing gives them."""
    torch.manual_seed(2)
    module = _Gated()
    for inner in (32, 24):
        expert = ExpertWeights(torch.randn(2 * inner, 48, dtype=dtype), torch.randn(48, inner, dtype=dtype))
        for num_rows in (1, 3, 64, 65, 300):
            x, weights = torch.randn(num_rows, 48, dtype=dtype), torch.rand(num_rows)
            slots = torch.zeros(num_rows, dtype=torch.int64)
            kernel = grouped_rows(module, expert.gate_up[None], expert.down[None], x, slots, weights, 1)
            direct = single_expert_rows(module, expert, x, weights)
            assert direct.dtype == kernel.dtype and torch.equal(direct, kernel), (inner, num_rows)
            assert direct.abs().sum() > 0


@pytest.fixture(scope="module")
def bf16_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("dispatch")
    return {arch: make_checkpoint(arch, root / arch, dtype=torch.bfloat16) for arch in ARCHITECTURES}


def _serve(path: pathlib.Path, **knobs: int) -> tuple[Engine, list, list]:
    """The prompts batched together (up to 3 at a time), exact-only; the engine, its outputs, its plans."""
    engine = Engine(EngineConfig(model_dir=str(path), block_size=4, max_num_seqs=3, **knobs), ExactLRUController())
    plans, step = [], engine.step

    def recorded_step():
        result = step()
        plan = engine.last_plan
        plans.append(
            (plan.kind, tuple(plan.request_ids), tuple(sorted(plan.num_tokens.items())), tuple(plan.preempted_ids))
        )
        return result

    engine.step = recorded_step
    outputs = engine.generate([list(p) for p in PROMPTS], SamplingParams(max_new_tokens=NEW_TOKENS))
    return engine, outputs, plans


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_batched_tokens_are_bitwise_equal_with_and_without_a_budget(arch: str, bf16_checkpoints) -> None:
    path = bf16_checkpoints[arch]
    roomy, reference, reference_plans = _serve(path)
    assert roomy.expert_store.stacked_layers  # everything fits: the stacked kernel
    expert, block = roomy.expert_store.bytes_per_expert, roomy.kv_store.bytes_per_block
    kv = 3 * 8 * roomy.kv_store.num_layers * block  # every block of every request: no preemption, no spill
    for num_experts in (3, 6):  # 3: below one layer's working set of a batched step
        knobs = {
            "device_budget_bytes": num_experts * expert + kv,
            "host_budget_bytes": 4 * expert,
            "is_emulated_device_tier": True,
        }
        engine, outputs, plans = _serve(path, **knobs)
        assert not engine.expert_store.stacked_layers and plans == reference_plans  # the same schedule
        assert all(not p[3] for p in plans)  # nothing preempted
        for out, ref in zip(outputs, reference, strict=True):
            assert out.output_token_ids == ref.output_token_ids, f"{arch} {num_experts} experts: tokens differ"
            assert torch.equal(out.output_logits, ref.output_logits), f"{arch} {num_experts}: logits not bitwise"
        loads = sum(o.tag_counts.get(Tag.EXACT_LOAD.value, 0) for o in outputs)
        uses = loads + sum(o.tag_counts.get(Tag.RESIDENT.value, 0) for o in outputs)
        assert loads >= 0.2 * uses, f"{arch} {num_experts}: {loads} of {uses} uses loaded"
        assert all(set(o.tag_counts) <= {Tag.EXACT_LOAD.value, Tag.RESIDENT.value} for o in outputs)


def test_row_owner_repeats_each_tokens_request_over_its_top_k() -> None:
    assert np.array_equal(row_owner([0, 0, 1], 2), [0, 0, 0, 0, 1, 1])

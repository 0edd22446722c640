"""MLA (DeepSeek-V2/V3): the per-request expansion of cached latents to every head's K/V is per-layer
staging counted in the device budget (Scratch.KV_EXPAND) for exactly the bytes it allocates, room made for
it first, so a long context runs with the pool's peak under the budget and the same tokens as without one."""

from __future__ import annotations

import pytest
import torch

from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.device_pool import Scratch
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.errors import BudgetError
from fallbackgate.engine.kv.paged_attention import expanded_kv_bytes
from fallbackgate.engine.sequence import SamplingParams
from tests.test_engine_exact import sizes
from tests.test_quant_bytes import storage_bytes

PROMPT = [3 + (7 * i) % 290 for i in range(400)]  # a long context for this model (512 positions)
NEW_TOKENS = 4


def _serve(engine: Engine) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Greedy tokens, and per expansion (bytes counted as KV_EXPAND, storage bytes of the K/V it made,
    the formula's bytes)."""
    pool, seen = engine.kv_store.device_pool, []
    for module in engine.runner.model.modules():
        if hasattr(module, "expand_kv"):
            expand = module.expand_kv

            def counted(latents, rope, expand=expand, module=module):
                keys, values = expand(latents, rope)
                if latents.shape[-2] == 1:  # the forward's own call on the one token the paged cache hands back
                    return keys, values
                formula = expanded_kv_bytes(module, latents.shape[-2], latents.dtype)
                seen.append((pool.used_bytes_by_kind[Scratch.KV_EXPAND], storage_bytes(keys, values), formula))
                assert pool.used_bytes <= pool.budget_bytes
                return keys, values

            module.expand_kv = counted
    engine.add_request(PROMPT, SamplingParams(max_new_tokens=NEW_TOKENS), "r")
    while engine.has_unfinished():
        engine.step()
        assert pool.used_bytes_by_kind[Scratch.KV_EXPAND] == 0  # held only while its attention runs
    return engine.finished["r"].output_token_ids, seen


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_the_expansion_is_counted_and_the_peak_stays_under_the_budget(arch: str, checkpoint_factory) -> None:
    path = checkpoint_factory(arch)
    expert, block, layers, top_k = sizes(path)
    free = Engine(EngineConfig(model_dir=str(path), block_size=4), ExactLRUController())
    expected, _ = _serve(free)
    module = next(m for m in free.runner.model.modules() if hasattr(m, "expand_kv"))
    expansion = expanded_kv_bytes(module, len(PROMPT) + NEW_TOKENS, torch.float32)
    kv = -(-(len(PROMPT) + NEW_TOKENS) // 4) * layers * block
    assert expansion > 4 * expert + kv / layers  # at this length the expansion outweighs a layer's KV and the experts
    budget = expansion + kv + 3 * top_k * expert  # room for it only by evicting experts
    engine = Engine(EngineConfig(model_dir=str(path), block_size=4, device_budget_bytes=budget,
                                 host_budget_bytes=0), ExactLRUController())  # fmt: skip
    tokens, seen = _serve(engine)
    assert tokens == expected
    assert seen and all(counted == held == formula for counted, held, formula in seen), seen[:3]
    pool = engine.kv_store.device_pool
    assert pool.peak_bytes_by_kind[Scratch.KV_EXPAND] == max(formula for *_, formula in seen)
    assert pool.peak_used_bytes <= budget


def test_a_request_whose_expansion_cannot_fit_is_refused_before_it_runs(checkpoint_factory) -> None:
    """The scheduler counts one request's expansion beside a layer's gathered K/V: a budget that holds the
    KV and the experts but not the expansion refuses the long request up front (no BudgetError mid-run)."""
    path = checkpoint_factory("deepseek_v2")
    expert, block, layers, top_k = sizes(path)
    probe = Engine(EngineConfig(model_dir=str(path), block_size=4), ExactLRUController())
    num_tokens = len(PROMPT) + NEW_TOKENS
    per_token = probe.kv_store.expand_bytes_per_token
    module = next(m for m in probe.runner.model.modules() if hasattr(m, "expand_kv"))
    assert per_token * num_tokens == expanded_kv_bytes(module, num_tokens, torch.float32) > 0
    kv = -(-num_tokens // 4) * layers * block
    # the experts, the KV, its gather and a quarter of the expansion
    budget = 3 * top_k * expert + kv + kv // layers + per_token * num_tokens // 4
    engine = Engine(EngineConfig(model_dir=str(path), block_size=4, device_budget_bytes=budget,
                                 host_budget_bytes=0), ExactLRUController())  # fmt: skip
    with pytest.raises(BudgetError, match="device budget"):
        engine.add_request(PROMPT, SamplingParams(max_new_tokens=NEW_TOKENS), "r")

"""Exact-only runs match transformers' own generate() and logits, from "everything fits" to the minimum."""

from __future__ import annotations

import pathlib

import pytest
import torch
from transformers import AutoModelForCausalLM

from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.sequence import SamplingParams
from tests.checkpoints import ARCHITECTURES

NEW_TOKENS = 12
PROMPT_LENGTHS = (5, 23, 2, 37)


def _prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def reference(path: pathlib.Path, prompts: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """transformers' own greedy generate() and teacher-forced logits at each generated position."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens, logits = [], []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                min_new_tokens=NEW_TOKENS,
                pad_token_id=0,
            )
            generated = out[0, len(prompt) :].tolist()
            tokens.append(generated)
            full = model(torch.tensor([prompt + generated[:-1]])).logits[0, len(prompt) - 1 :]
            logits.append(full)
    return tokens, logits


def sizes(path: pathlib.Path) -> tuple[int, int, int, int]:
    """(bytes per expert, bytes per KV block of 4 tokens, num layers, top_k) of a checkpoint."""
    config = EngineConfig(model_dir=str(path), block_size=4, host_budget_bytes=0, is_stacked_when_fits=False)
    engine = Engine(config, ExactLRUController())  # sizes only: it reads no expert
    return (
        engine.expert_store.bytes_per_expert,
        engine.kv_store.bytes_per_block,
        engine.kv_store.num_layers,
        engine.model_config.num_experts_per_tok,
    )


def one_request_budget(path: pathlib.Path, num_tokens: int) -> int:
    """The smallest device budget that runs one request of `num_tokens` (block size 4): all its KV blocks
    beside the experts of one layer's top-k, and beside one layer's gathered K/V."""
    expert, block, layers, top_k = sizes(path)
    num_blocks = -(-num_tokens // 4)
    return num_blocks * layers * block + max(top_k * expert, num_blocks * block if num_blocks > 1 else 0)


def budgets(path: pathlib.Path) -> dict[str, dict]:
    expert, block, layers, top_k = sizes(path)
    minimum = one_request_budget(path, max(map(len, _prompts(1))) + NEW_TOKENS)
    return {
        "everything_fits": {},
        "half_experts": {"device_budget_bytes": 10 * expert + 40 * layers * block},
        "tight_swap_disk": {  # host copies: CUDA's layout, emulated in RAM
            "device_budget_bytes": minimum + 3 * layers * block,
            "host_budget_bytes": 30 * expert,
            "is_emulated_device_tier": True,
        },
        "minimum": {"device_budget_bytes": minimum},
    }


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_exact_only_matches_transformers(arch: str, checkpoint_factory) -> None:
    path = checkpoint_factory(arch)
    prompts = _prompts(1)
    ref_tokens, ref_logits = reference(path, prompts)
    for name, knobs in budgets(path).items():
        config = EngineConfig(model_dir=str(path), block_size=4, max_num_seqs=3, **knobs)
        engine = Engine(config, ExactLRUController())
        outputs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
        tags: dict[str, int] = {}
        for out, tokens, logits in zip(outputs, ref_tokens, ref_logits, strict=True):
            assert out.output_token_ids == tokens, f"{arch}/{name}: greedy tokens differ"
            assert (out.output_logits - logits).abs().max().item() < 1e-5, f"{arch}/{name}: logits differ"
            for tag, count in out.tag_counts.items():
                tags[tag] = tags.get(tag, 0) + count
        assert set(tags) <= {"resident", "exact_load", "recompute"}, f"{arch}/{name}: {tags}"
        if name != "everything_fits":
            assert tags.get("exact_load", 0) > 50, f"{arch}/{name}: budget did not force loads: {tags}"


def test_bundled_checkpoint_exact_only_matches_transformers() -> None:
    from fallbackgate.tinymoe import CHECKPOINT_DIR

    if not (CHECKPOINT_DIR / "model.safetensors").exists():
        pytest.skip("checkpoint not built")
    prompts = _prompts(7)
    ref_tokens, ref_logits = reference(CHECKPOINT_DIR, prompts)
    probe = Engine(EngineConfig(model_dir=str(CHECKPOINT_DIR), block_size=4), ExactLRUController())
    store, kv = probe.expert_store, probe.kv_store
    budget = int(0.4 * len(store.entries)) * store.bytes_per_expert + 20 * kv.num_layers * kv.bytes_per_block
    engine = Engine(
        EngineConfig(model_dir=str(CHECKPOINT_DIR), block_size=4, max_num_seqs=4, device_budget_bytes=budget),
        ExactLRUController(),
    )
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
    for out, tokens, logits in zip(outputs, ref_tokens, ref_logits, strict=True):
        assert out.output_token_ids == tokens
        # trained logits reach ~20: fp32 rounding of a different summation order is ~1e-6 of that
        torch.testing.assert_close(out.output_logits, logits, rtol=1e-5, atol=1e-5)
    assert sum(out.tag_counts.get("exact_load", 0) for out in outputs) > 20

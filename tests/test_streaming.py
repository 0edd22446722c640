"""The engine at its checkpoint's own dtype, streaming experts from the safetensors files.

- exact-only runs in bf16 are bitwise equal to transformers' grouped_mm experts (same kernel, same order)
  on every architecture the loader accepts, whether everything fits (each layer's experts stacked on the
  device) or a budget forces loads from host and disk into the slot pool;
- the model never holds routed experts; dense weights keep the checkpoint's dtype;
- per-expert, fused and sharded layouts serve identical tokens; low-bit copies exist only once asked for;
- on a CPU the device tier aliases the host cache (no expert is held twice).
"""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from fallbackgate.controllers.exact_lru import ExactLRUController
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.experts.manifest import MANIFEST_FILE, build_manifest
from fallbackgate.engine.model.checkpoint_files import INDEX_FILE
from fallbackgate.engine.sequence import SamplingParams
from fallbackgate.engine.tags import ObjectKind, Tag
from tests.checkpoints import ARCHITECTURES, make_checkpoint

NEW_TOKENS = 8
PROMPTS = ([5, 17, 33, 9, 101, 250, 7, 64, 12, 3, 88], [44, 2, 190, 31, 6])


@pytest.fixture(scope="module")
def bf16_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("bf16")
    return {arch: make_checkpoint(arch, root / arch, dtype=torch.bfloat16) for arch in ARCHITECTURES}


def eager_reference(path: pathlib.Path, experts: str = "eager") -> list[tuple[list[int], torch.Tensor]]:
    """transformers' greedy generate() in bf16 with its `experts` implementation: tokens and per-step logits."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, experts_implementation=experts).eval()
    model.generation_config.eos_token_id = None  # the engine stops only on stop_token_ids: never stop early
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            gen = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
            out.append((gen.sequences[0, len(prompt) :].tolist(), torch.cat(gen.logits)))
    return out


def serve(path: pathlib.Path, **knobs: int) -> Engine:
    """One request at a time (the batch shapes of generate()), exact-only."""
    return Engine(EngineConfig(model_dir=str(path), block_size=4, max_num_seqs=1, **knobs), ExactLRUController())


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_bf16_exact_only_is_bitwise_equal_to_transformers(arch: str, bf16_checkpoints) -> None:
    path = bf16_checkpoints[arch]
    reference = eager_reference(path, "grouped_mm")
    probe = serve(path)
    assert probe.dtype == torch.bfloat16 and probe.kv_store.dtype == torch.bfloat16
    expert, block = probe.expert_store.bytes_per_expert, probe.kv_store.bytes_per_block
    device = 3 * expert + 12 * probe.kv_store.num_layers * block
    tight = {"device_budget_bytes": device, "host_budget_bytes": 4 * expert, "is_emulated_device_tier": True}
    for knobs in ({}, tight):
        engine = serve(path, **knobs)
        assert bool(engine.expert_store.stacked_layers) is not bool(knobs)  # everything fits: stacked
        outputs = engine.generate([list(p) for p in PROMPTS], SamplingParams(max_new_tokens=NEW_TOKENS))
        for out, (tokens, logits) in zip(outputs, reference, strict=True):
            assert out.output_token_ids == tokens, f"{arch} {knobs}: tokens differ"
            assert torch.equal(out.output_logits.to(logits.dtype), logits), f"{arch} {knobs}: logits not bitwise"
        if knobs:
            assert sum(o.tag_counts.get("exact_load", 0) for o in outputs) > 20
            assert engine.expert_store.num_disk_reads > 10  # the host cache holds 4 experts: most come from files


def test_the_model_holds_no_experts_and_dense_weights_keep_their_dtype(bf16_checkpoints) -> None:
    path = bf16_checkpoints["qwen3_moe"]
    engine = serve(path, device_budget_bytes=serve(path).expert_store.bytes_per_expert * 40)
    params = dict(engine.runner.model.named_parameters())
    experts = {n: p for n, p in params.items() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    assert experts and all(p.numel() == 0 for p in experts.values())
    assert {p.dtype for n, p in params.items() if n not in experts} == {torch.bfloat16}
    assert not any(p.is_meta for p in params.values())


def test_when_everything_fits_the_stacks_are_the_only_expert_copies(bf16_checkpoints) -> None:
    engine = serve(bf16_checkpoints["qwen3_moe"])
    store = engine.expert_store
    modules = engine.loaded_experts
    assert store.stacked_layers == set(modules) and not store.host_lru
    for (layer, expert_id), entry in store.entries.items():
        stack = modules[layer].gate_up_proj
        assert entry.host is None and entry.device.gate_up.data_ptr() == stack[expert_id].data_ptr()
    used = store.device_pool.used_bytes_by_kind[ObjectKind.EXPERT]
    assert (
        used
        == len(store.entries) * store.bytes_per_expert
        == sum(m.gate_up_proj.nbytes + m.down_proj.nbytes for m in modules.values())
    )


def _reshard_fused(source: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
    """The same weights with fused [E, ...] expert tensors, split over two shards with an index."""
    shutil.copytree(source, dest)
    (dest / "model.safetensors").unlink()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: state[n] for n in part}, str(dest / file), metadata={"format": "pt"})
    weight_map = {n: file for file, part in halves.items() for n in part}
    (dest / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    build_manifest(dest)
    return dest


def test_fused_sharded_layout_serves_the_same_tokens(bf16_checkpoints, tmp_path: pathlib.Path) -> None:
    source = bf16_checkpoints["olmoe"]
    fused = _reshard_fused(source, tmp_path / "fused")
    weight_map = json.loads((fused / INDEX_FILE).read_text())["weight_map"]
    assert any(name.endswith("experts.gate_up_proj") for name in weight_map)
    a = serve(source).generate([list(p) for p in PROMPTS], SamplingParams(max_new_tokens=NEW_TOKENS))
    b = serve(fused).generate([list(p) for p in PROMPTS], SamplingParams(max_new_tokens=NEW_TOKENS))
    for x, y in zip(a, b, strict=True):
        assert x.output_token_ids == y.output_token_ids and torch.equal(x.output_logits, y.output_logits)


def test_manifest_digests_match_an_independent_hash_of_the_model(bf16_checkpoints, tmp_path: pathlib.Path) -> None:
    path = shutil.copytree(bf16_checkpoints["mixtral"], tmp_path / "mixtral")
    written_by_test = json.loads((path / MANIFEST_FILE).read_text())  # digests from the model's own tensors
    build_manifest(path)  # digests from the reader's mapping of the files
    assert json.loads((path / MANIFEST_FILE).read_text()) == written_by_test
    assert any("w1.weight" in part[0] for part in written_by_test["experts"]["1:0"]["parts"])  # Mixtral's names


def test_lowbit_copies_are_made_on_demand_within_the_host_budget(bf16_checkpoints) -> None:
    path = bf16_checkpoints["qwen3_moe"]
    probe = serve(path)
    expert = probe.expert_store.bytes_per_expert
    scratch = probe.expert_store.lowbit_scratch_bytes  # a dequantized low-bit copy is counted on device too
    budget = 2 * expert + scratch + 12 * probe.kv_store.num_layers * probe.kv_store.bytes_per_block
    engine = Engine(
        EngineConfig(
            model_dir=str(path),
            block_size=4,
            device_budget_bytes=budget,
            host_budget_bytes=0,
            is_emulated_device_tier=True,
        ),
        ExactLRUController(force=[Tag.EXPERT_LOWBIT]),
    )
    assert not any(e.lowbit for e in engine.expert_store.entries.values())
    outputs = engine.generate([list(PROMPTS[0])], SamplingParams(max_new_tokens=NEW_TOKENS))
    assert outputs[0].tag_counts.get("expert_lowbit", 0) > 0
    assert not any(e.lowbit for e in engine.expert_store.entries.values())  # no host budget: made, used, dropped
    roomy = Engine(
        EngineConfig(
            model_dir=str(path),
            block_size=4,
            device_budget_bytes=budget,
            host_budget_bytes=6 * expert,
            is_emulated_device_tier=True,
        ),
        ExactLRUController(force=[Tag.EXPERT_LOWBIT]),
    )
    roomy.generate([list(PROMPTS[0])], SamplingParams(max_new_tokens=NEW_TOKENS))
    kept = [k for k, e in roomy.expert_store.entries.items() if e.lowbit]
    assert kept and roomy.kv_store.host_pool.peak_used_bytes <= 6 * expert


def test_cpu_device_tier_aliases_the_host_cache(bf16_checkpoints) -> None:
    engine = serve(bf16_checkpoints["olmoe"])
    store = engine.expert_store
    engine.generate([list(PROMPTS[0])], SamplingParams(max_new_tokens=NEW_TOKENS))
    on_device = store.device_keys()
    assert on_device and all(store.entries[k].host is None for k in on_device)  # never held twice
    cached = sum(1 for e in store.entries.values() if e.host is not None)
    assert store.device_pool.used_bytes_by_kind[ObjectKind.EXPERT] == len(on_device) * store.bytes_per_expert
    assert cached + len(on_device) <= len(store.entries)

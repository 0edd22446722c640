"""Small random-initialised MoE checkpoints of several architectures, saved with a tokenizer."""

from __future__ import annotations

import pathlib

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    LlamaConfig,
    MixtralConfig,
    OlmoeConfig,
    PreTrainedTokenizerFast,
    Qwen3MoeConfig,
)

from fallbackgate.engine.experts.manifest import weights_digest, write_manifest
from fallbackgate.engine.experts.sources import map_experts
from fallbackgate.engine.experts.weights import ExpertWeights
from fallbackgate.engine.model.checkpoint_files import CheckpointFiles
from fallbackgate.engine.model.loader import find_experts_modules

VOCAB = 320
ARCHITECTURES = ("qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "deepseek_v2")
_TEXT = ("the quick brown fox jumps over the lazy dog. once upon a time a princess lived in a castle. " * 20).split(
    ". "
)


def _config(arch: str, num_experts: int = 8) -> object:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=512,
        num_experts_per_tok=2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(
            **common,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=num_experts,
            norm_topk_prob=True,
        )
    if arch == "mixtral":
        return MixtralConfig(**common, intermediate_size=32, num_key_value_heads=2, num_local_experts=num_experts)
    if arch == "olmoe":
        return OlmoeConfig(**common, intermediate_size=32, num_key_value_heads=4, num_experts=num_experts)
    if arch in ("deepseek_v3", "deepseek_v2"):  # MLA attention: K/V expanded to every head, key and value widths differ
        mla = dict(
            **common,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_key_value_heads=4,
            n_routed_experts=num_experts,
            n_shared_experts=1,
            first_k_dense_replace=1,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
        )
        if arch == "deepseek_v3":
            return DeepseekV3Config(**mla, n_group=2, topk_group=1)
        return DeepseekV2Config(**mla, topk_method="greedy", n_group=1, topk_group=1)
    if arch == "llama":
        return LlamaConfig(**common, intermediate_size=96, num_key_value_heads=2)
    raise ValueError(arch)


def save_tokenizer(path: pathlib.Path) -> None:
    """A byte-level BPE tokenizer trained on a few sentences."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_TEXT, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)


def make_checkpoint(
    arch: str, path: pathlib.Path, seed: int = 0, num_experts: int = 8, dtype: torch.dtype = torch.float32
) -> pathlib.Path:
    """Save a seeded random `arch` model (in `dtype`), its expert manifest and a tokenizer into `path`.

    The manifest's digests come from the model's own fused expert tensors, not from reading the files back,
    so a reader that maps the wrong tensors to an expert fails its check.
    """
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch, num_experts))
    with torch.no_grad():  # widen the weights a little so logits vary enough to compare paths
        for name, param in model.named_parameters():
            if "norm" not in name and param.dim() >= 2:
                param.mul_(3.0)
    model = model.to(dtype)
    model.save_pretrained(path)
    save_tokenizer(path)
    digests = {}
    for layer, module in find_experts_modules(model).items():
        for e in range(module.num_experts):
            weights = ExpertWeights(module.gate_up_proj.data[e], module.down_proj.data[e])
            digests[(layer, e)] = weights_digest(weights)
    write_manifest(path, digests, map_experts(CheckpointFiles(path)))
    return path

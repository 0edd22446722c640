"""Published MoE configurations (shapes only) that `fallbackgate.synth` reproduces with random weights.

Every name also has an ``-fp8`` variant: the same shapes stored as DeepSeek-V3 and Qwen3-FP8 ship their
weights (block-scaled e4m3, 128 × 128 blocks, bf16 compute).
"""

from __future__ import annotations

from typing import Any

# name -> (model_type, config fields as published on each model's config.json)
PUBLISHED: dict[str, tuple[str, dict[str, Any]]] = {
    "olmoe-1b-7b": (
        "olmoe",
        dict(
            vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
            num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
            max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5, norm_topk_prob=False,
            clip_qkv=None, tie_word_embeddings=False,
        ),
    ),
    "qwen3-30b-a3b": (
        "qwen3_moe",
        dict(
            vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
            num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
            num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
            max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        ),
    ),
    "mixtral-8x7b": (
        "mixtral",
        dict(
            vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
            max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        ),
    ),
    "deepseek-v3": (
        "deepseek_v3",
        dict(
            vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
            num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256,
            n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3, kv_lora_rank=512, q_lora_rank=1536,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_group=8, topk_group=4,
            routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=163840, rope_theta=10000.0,
            rms_norm_eps=1e-6, tie_word_embeddings=False,
        ),
    ),
    "deepseek-v2-lite": (
        "deepseek_v2",
        dict(
            vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
            num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64,
            n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512,
            q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_group=1,
            topk_group=1, topk_method="greedy", routed_scaling_factor=1.0, norm_topk_prob=False,
            max_position_embeddings=163840, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        ),
    ),
}

FP8_SUFFIX = "-fp8"
FP8_BLOCK = (128, 128)  # the weight_block_size both publish


def resolve(name: str) -> tuple[str, dict[str, Any], tuple[int, int] | None] | None:
    """(model_type, config fields, FP8 block or None) for a published name or its ``-fp8`` variant."""
    base = name.removesuffix(FP8_SUFFIX)
    if base not in PUBLISHED:
        return None
    model_type, fields = PUBLISHED[base]
    return model_type, fields, FP8_BLOCK if name.endswith(FP8_SUFFIX) else None


ALL_NAMES: tuple[str, ...] = tuple(n for base in PUBLISHED for n in (base, base + FP8_SUFFIX))

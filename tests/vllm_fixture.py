"""vLLM ``/v1/completions`` responses with routed experts, built to vLLM's own layouts for the bundled model's
shape (5 decoder layers, layer 0 dense, 16 experts, top-2); ``python -m tests.vllm_fixture`` rewrites
``tests/data/vllm_completions_routed.json``.

- ``full`` (``CompletionResponseChoice.routed_experts`` in ``vllm/entrypoints/openai/completion/protocol.py``):
  base64 of ``np.save`` bytes, shape ``(prompt + generated - 1, num_hidden_layers, top_k)``; the dense layer's
  entries are zero, as vLLM's capturer leaves layers no router writes.
- ``split`` (vLLM 0.21 docs): ``prompt_routed_experts`` [prompt, MoE layers, k] on the response and
  ``routed_experts`` [generated - 1, MoE layers, k] per choice, as nested lists.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np

NUM_LAYERS, DENSE, NUM_EXPERTS, TOP_K = 5, (0,), 16, 2
LENGTHS = [(7, 5), (12, 3), (4, 9), (20, 1)]  # (prompt tokens, generated tokens) per request
FILE = Path(__file__).parent / "data" / "vllm_completions_routed.json"


def routing(seed: int, positions: int) -> np.ndarray:
    """Distinct top-k ids per token and MoE layer, zeros in the dense layer: [positions, layers, k] int32."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((positions, NUM_LAYERS, TOP_K), dtype=np.int32)
    for layer in range(NUM_LAYERS):
        if layer not in DENSE:
            ids[:, layer] = np.argsort(rng.random((positions, NUM_EXPERTS)), axis=1)[:, :TOP_K]
    return ids


def npy_base64(array: np.ndarray) -> str:
    """What vLLM's server puts in ``routed_experts``: base64 of the ``.npy`` bytes."""
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def full_response(index: int, prompt: int, generated: int, dtype: str = "int32") -> dict:
    """One ``/v1/completions`` response in the full layout (``return_token_ids`` on)."""
    ids = routing(index, prompt + generated - 1).astype(dtype)
    return {
        "id": f"cmpl-{index}", "object": "text_completion", "created": 0, "model": "tinymoe",
        "choices": [{"index": 0, "text": "", "finish_reason": "length", "prompt_token_ids": list(range(prompt)),
                     "token_ids": list(range(generated)), "routed_experts": npy_base64(ids)}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated},
    }  # fmt: skip


def split_response(index: int, prompt: int, generated: int) -> dict:
    """The same request in the split layout: MoE layers only, prompt and generated routing apart."""
    moe = [layer for layer in range(NUM_LAYERS) if layer not in DENSE]
    ids = routing(index, prompt + generated - 1)[:, moe]
    return {
        "id": f"cmpl-{index}", "object": "text_completion", "created": 0, "model": "tinymoe",
        "prompt_routed_experts": ids[:prompt].tolist(),
        "choices": [{"index": 0, "text": "", "finish_reason": "length", "routed_experts": ids[prompt:].tolist()}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated},
    }  # fmt: skip


def responses(layout: str = "full") -> list[dict]:
    """Every request's response in one layout (the full one alternates int32 and uint8 payloads)."""
    if layout == "split":
        return [split_response(i, p, g) for i, (p, g) in enumerate(LENGTHS)]
    return [full_response(i, p, g, "int32" if i % 2 == 0 else "uint8") for i, (p, g) in enumerate(LENGTHS)]


if __name__ == "__main__":
    FILE.write_text(json.dumps(responses(), indent=1) + "\n")

"""The narrow engine API of the exact and replay baselines: everything the audit uses of the engine.

- :class:`BaselineEngine`: an engine as the audit sees it (its dense-weight check, exact passes, replay pass,
  verified expert copies, and the shapes a replay needs);
- :func:`build_baseline_engine`: an engine that only audits (no expert in memory: the baselines read every
  expert from the checkpoint files);
- the engine's own arithmetic that a replay repeats: :func:`expert_mlp`, :func:`lowbit_round_trip`,
  :func:`kv_round_trip`.
"""

from __future__ import annotations

import torch

from fallbackgate.engine.baseline.access import BaselineAccess
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.controller import Controller
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.experts.hook import expert_mlp
from fallbackgate.engine.experts.quant import dequantize_rows, quantize, quantized_to
from fallbackgate.engine.experts.store import DEQUANT_ROWS
from fallbackgate.engine.experts.weights import ExpertWeights
from fallbackgate.engine.kv.codec import dequantize_kv, quantize_kv

BaselineEngine = Engine  # the engine type the audit's passes run on (see BaselineAccess for what they use)

__all__ = [
    "BaselineAccess",
    "BaselineEngine",
    "ExpertWeights",
    "build_baseline_engine",
    "expert_mlp",
    "kv_round_trip",
    "lowbit_round_trip",
]


def build_baseline_engine(model_dir: str, dtype: str | None, block_size: int, controller: Controller) -> Engine:
    """An engine for audits only: no host cache, no stacked experts, no read threads, no copy checks."""
    config = EngineConfig(
        model_dir,
        dtype=dtype,
        block_size=block_size,
        host_budget_bytes=0,
        is_stacked_when_fits=False,
        num_io_threads=0,
        num_verified_copies_per_step=0,
    )
    return Engine(config, controller)


def lowbit_round_trip(weights: ExpertWeights, bits: int, device: torch.device) -> ExpertWeights:
    """An expert's weights quantized to `bits` and dequantized as the store's low-bit copies are."""
    parts = (quantize(weights.gate_up, bits, axis=1), quantize(weights.down, bits, axis=1))
    dtype = weights.gate_up.dtype
    return ExpertWeights(*(dequantize_rows(quantized_to(p, device), dtype, DEQUANT_ROWS) for p in parts))


def kv_round_trip(packed: torch.Tensor, bits: int, key_dim: int) -> torch.Tensor:
    """A [kv_heads, tokens, key_dim + value_dim] block quantized to `bits` and dequantized by the KV codec."""
    return dequantize_kv(quantize_kv(packed, bits, key_dim))

"""The narrow engine API of the exact and replay baselines: everything the audit uses of the engine.

- :class:`BaselineEngine`: an engine as the audit sees it (its dense-weight check, exact passes, replay pass,
  verified expert copies, and the shapes a replay needs);
- :func:`build_baseline_engine`: an engine that only audits (no expert in memory: the baselines read every
  expert from the checkpoint files), and :class:`ExactController`, the controller of such engines;
- the engine's own arithmetic that a replay repeats: :func:`stacked_forward` (the served experts kernel),
  :func:`lowbit_round_trip`, :func:`kv_round_trip`.
"""

from __future__ import annotations

import itertools
from collections.abc import Container, Iterable

import torch

from fallbackgate.engine.baseline.access import BaselineAccess
from fallbackgate.engine.config import EngineConfig
from fallbackgate.engine.controller import (
    Controller,
    ControllerView,
    Decision,
    ExpertMiss,
    KVBlockKey,
    KVMiss,
    Victim,
)
from fallbackgate.engine.engine import Engine
from fallbackgate.engine.experts.grouped import stacked_forward
from fallbackgate.engine.experts.quant import quantize
from fallbackgate.engine.experts.sources import ExpertKey
from fallbackgate.engine.experts.store import dequantized
from fallbackgate.engine.experts.weights import ExpertWeights
from fallbackgate.engine.kv.codec import dequantize_kv, quantize_kv
from fallbackgate.engine.tags import Tag

BaselineEngine = Engine  # the engine type the audit's passes run on (see BaselineAccess for what they use)

__all__ = [
    "BaselineAccess",
    "BaselineEngine",
    "ExactController",
    "ExpertWeights",
    "build_baseline_engine",
    "stacked_forward",
    "kv_round_trip",
    "lowbit_round_trip",
]


class ExactController(Controller):
    """Serves every miss exactly and takes victims in the engine's order (experts, then KV blocks): the
    controller of engines that compute baselines or measure step times, where nothing may be approximate."""

    def expert_action(self, miss: ExpertMiss) -> Decision:
        return Decision(Tag.EXACT_LOAD)

    def kv_action(self, miss: KVMiss) -> Decision:
        if miss.exact_tier is not None:
            return Decision(Tag.EXACT_LOAD)
        return Decision(Tag.RECOMPUTE, reason="no full-precision copy")

    def choose_victims(
        self,
        num_bytes: int,
        view: ControllerView,
        pinned_experts: Container[ExpertKey],
        pinned_kv: Container[KVBlockKey],
    ) -> Iterable[Victim]:
        experts = (Victim(expert_key=k) for k in view.device_expert_keys() if k not in pinned_experts)
        blocks = (b.key for rid in view.kv_request_ids for b in view.device_kv_blocks_of(rid))  # lazily
        return itertools.chain(experts, (Victim(kv_block_key=k) for k in blocks if k not in pinned_kv))


def build_baseline_engine(model_dir: str, dtype: str | None, block_size: int) -> Engine:
    """An engine for audits only: no host cache, no stacked experts, no read threads, no copy checks."""
    config = EngineConfig(
        model_dir=model_dir,
        dtype=dtype,
        block_size=block_size,
        host_budget_bytes=0,
        is_stacked_when_fits=False,
        num_io_threads=0,
        num_verified_copies_per_step=0,
    )
    return Engine(config, ExactController())


def lowbit_round_trip(weights: ExpertWeights, bits: int, device: torch.device) -> ExpertWeights:
    """An expert's weights quantized to `bits` and dequantized as the store's low-bit copies are."""
    parts = (quantize(weights.gate_up, bits, axis=1), quantize(weights.down, bits, axis=1))
    dtype = weights.gate_up.dtype
    return ExpertWeights(*(dequantized(p, device, dtype) for p in parts))


def kv_round_trip(packed: torch.Tensor, bits: int, key_dim: int) -> torch.Tensor:
    """A [kv_heads, tokens, key_dim + value_dim] block quantized to `bits` and dequantized by the KV codec."""
    return dequantize_kv(quantize_kv(packed, bits, key_dim))

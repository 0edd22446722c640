"""One routed expert's matrices, as the engine moves and computes with them."""

from __future__ import annotations

import dataclasses

import torch

from fallbackgate.engine.tags import Tier


@dataclasses.dataclass(slots=True)
class ExpertWeights:
    """One routed expert's matrices in transformers' layout."""

    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]

    @property
    def num_bytes(self) -> int:
        """Bytes of both matrices in their dtype."""
        return sum(t.numel() * t.element_size() for t in (self.gate_up, self.down))


@dataclasses.dataclass(slots=True)
class BlockScaled:
    """One FP8 expert as the checkpoint stores it and the host cache holds it: e4m3 codes in transformers'
    layout and the float32 ``weight_scale_inv`` blocks of each part (gate, up, down)."""

    gate_up: torch.Tensor  # [2 * intermediate, hidden] FP8 codes (gate rows, then up rows)
    down: torch.Tensor  # [hidden, intermediate] FP8 codes
    scales: tuple[torch.Tensor, ...]  # gate, up, down block scales ([rows / bm, cols / bn] each)

    @property
    def num_bytes(self) -> int:
        """Bytes held: one per code, plus the scales in their dtype."""
        return sum(t.numel() * t.element_size() for t in (self.gate_up, self.down, *self.scales))


HeldWeights = ExpertWeights | BlockScaled  # what a host copy or a read holds before it is computed with


@dataclasses.dataclass(slots=True)
class Fetched:
    """Weights handed to a caller, with what it cost to get them."""

    weights: ExpertWeights  # ready to compute with
    source_tier: Tier | None  # where bytes came from (None: nothing moved)
    bytes_moved: int  # bytes read over a link (from the disk: the checkpoint's bytes, codes and scales as stored)
    note: str = ""  # e.g. a checksum failure that a re-read cleared

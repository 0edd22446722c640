"""One routed expert's matrices, as the engine moves and computes with them."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(slots=True)
class ExpertWeights:
    """One routed expert's matrices in transformers' layout."""

    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]

    @property
    def num_bytes(self) -> int:
        """Bytes of both matrices in their dtype."""
        return sum(t.numel() * t.element_size() for t in (self.gate_up, self.down))

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
class Fetched:
    """Weights handed to a caller, with what it cost to get them."""

    weights: ExpertWeights  # ready to compute with
    source_tier: Tier | None  # where bytes came from (None: nothing moved)
    bytes_moved: int  # bytes read over a link (from the disk: the checkpoint's bytes, codes and scales as stored)
    note: str = ""  # e.g. a checksum failure that a re-read cleared

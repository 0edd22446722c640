"""Predicted quality cost of approximate actions, in predicted KL nats per generated position.

Each approximate tag has a cheap proxy computed from what the controller sees:

- ``expert_defer``: the skipped expert's gate weight, squared (the output moves by ~w × the expert's output);
- ``expert_lowbit``: the gate weight squared times the relative error energy of a ``bits``-bit weight copy;
- ``kv_dequant``: the relative quantization error energy ‖x − Q(x)‖² / ‖x‖² of the KV block read.

A proxy times a per-tag, per-layer scale gives predicted nats. Scales start at conservative defaults
and are replaced by ``fallbackgate calibrate``, which fits them against the ledger's measured KL and
stores them in the ``calibrations`` table; :func:`load_calibration` reads the newest fit per tag × layer.
Equivalent tags (``cpu_execute``, ``recompute``) cost nothing: they are the same math.
"""

from __future__ import annotations

import dataclasses

import torch
from sqlalchemy import select

from fallbackgate.engine.kv.codec import dequantize_kv, quantize_kv
from fallbackgate.engine.tags import Tag
from fallbackgate.ledger.db import Ledger
from fallbackgate.ledger.models import Calibration

# predicted nats per unit of proxy before calibration: deliberately on the high side
DEFAULT_SCALES: dict[Tag, float] = {Tag.EXPERT_DEFER: 2.0, Tag.EXPERT_LOWBIT: 2.0, Tag.KV_DEQUANT: 2.0}
CALIBRATED_TAGS: tuple[Tag, ...] = tuple(DEFAULT_SCALES)


def lowbit_error_energy(bits: int) -> float:
    """Relative error energy of symmetric ``bits``-bit rounding of roughly Gaussian weights (max ≈ 3.5σ)."""
    levels = 2 ** (bits - 1) - 1
    return (3.5 / levels) ** 2 / 12.0


def kv_error_energy(block: torch.Tensor, bits: int, key_dim: int) -> float:
    """Relative quantization error energy of one KV block's ``bits``-bit copy (the codec the engine uses)."""
    restored = dequantize_kv(quantize_kv(block, bits, key_dim)).to(block.device)
    energy = float(block.float().pow(2).sum())
    return float((block.float() - restored).pow(2).sum()) / energy if energy > 0 else 0.0


@dataclasses.dataclass
class CostModel:
    """Proxy × scale per tag and layer; scales default per tag until a calibration is loaded."""

    scales: dict[tuple[Tag, int], float] = dataclasses.field(default_factory=dict)
    defaults: dict[Tag, float] = dataclasses.field(default_factory=lambda: dict(DEFAULT_SCALES))
    lowbit_bits: int = 8

    def scale(self, tag: Tag, layer: int) -> float:
        """The scale of `tag` in `layer` (0 for exact and equivalent tags)."""
        if not tag.is_approximate:
            return 0.0
        return self.scales.get((tag, layer), self.defaults.get(tag, 1.0))

    def proxy_expert(self, tag: Tag, gate_weight: float) -> float:
        """Proxy value of serving an expert with `tag` for a token group whose largest gate weight is given."""
        if tag is Tag.EXPERT_DEFER:
            return gate_weight**2
        if tag is Tag.EXPERT_LOWBIT:
            return gate_weight**2 * lowbit_error_energy(self.lowbit_bits)
        return 0.0

    def expert_cost(self, tag: Tag, layer: int, gate_weight: float) -> float:
        """Predicted nats of an expert action."""
        return self.scale(tag, layer) * self.proxy_expert(tag, gate_weight)

    def kv_cost(self, layer: int, error_energy: float) -> float:
        """Predicted nats of reading one dequantized KV block with the given relative error energy."""
        return self.scale(Tag.KV_DEQUANT, layer) * error_energy

    @property
    def is_calibrated(self) -> bool:
        return bool(self.scales)


def load_calibration(ledger: Ledger, lowbit_bits: int = 8) -> CostModel:
    """A cost model with the newest fitted scale per tag × layer from the ledger (defaults where none)."""
    table = Calibration.__table__
    stmt = select(table.c.tag, table.c.layer, table.c.scale).order_by(table.c.fitted_at, table.c.id)
    scales: dict[tuple[Tag, int], float] = {}
    with ledger.engine.connect() as conn:
        for tag, layer, scale in conn.execute(stmt):
            try:
                scales[(Tag(tag), int(layer))] = float(scale)
            except ValueError:
                continue
    model = CostModel(scales=scales, lowbit_bits=lowbit_bits)
    for tag in CALIBRATED_TAGS:  # layers without their own fit use the mean fitted scale of the tag
        fitted = [s for (t, _), s in scales.items() if t is tag]
        if fitted:
            model.defaults[tag] = max(fitted)
    return model

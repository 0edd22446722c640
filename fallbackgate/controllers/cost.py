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
from typing import Any

import torch
from sqlalchemy import func, select

from fallbackgate.engine.kv.codec import dequantize_kv, quantize_kv
from fallbackgate.engine.tags import Exactness, Tag
from fallbackgate.ledger.db import Ledger
from fallbackgate.ledger.models import Calibration, EventRow, RequestStatRow
from fallbackgate.ledger.writer import LedgerWriter

# predicted nats per unit of proxy before calibration: deliberately on the high side
DEFAULT_SCALES: dict[Tag, float] = {Tag.EXPERT_DEFER: 2.0, Tag.EXPERT_LOWBIT: 2.0, Tag.KV_DEQUANT: 2.0}
CALIBRATED_TAGS: tuple[Tag, ...] = tuple(DEFAULT_SCALES)
MIN_SCALE = 1e-6  # a fitted scale never reaches 0: a tag that measured nothing still costs a little


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


# --- fitting the scales from a ledger (``fallbackgate calibrate``) ------------------------------------------


def request_samples(ledger: Ledger, run_ids: list[int]) -> list[dict[str, Any]]:
    """Per audited request: measured KL summed over positions and predicted nats per (tag, layer)."""
    ev = EventRow
    stmt = (
        select(ev.run_id, ev.request_id, ev.tag, ev.layer, func.sum(ev.predicted_cost).label("predicted"))
        .where(ev.exactness == Exactness.APPROXIMATE.value, ev.predicted_cost > 0)
        .group_by(ev.run_id, ev.request_id, ev.tag, ev.layer)
    )
    stats = select(
        RequestStatRow.run_id, RequestStatRow.request_id, RequestStatRow.mean_kl, RequestStatRow.num_positions
    )
    if run_ids:
        stmt, stats = stmt.where(ev.run_id.in_(run_ids)), stats.where(RequestStatRow.run_id.in_(run_ids))
    samples: dict[tuple[int, str], dict[str, Any]] = {}
    with ledger.engine.connect() as conn:
        for run_id, request_id, mean_kl, num in conn.execute(stats):
            samples[(run_id, request_id)] = {"run_id": run_id, "measured": mean_kl * num, "predicted": {}}
        for run_id, request_id, tag, layer, predicted in conn.execute(stmt):
            if (run_id, request_id) in samples:
                samples[(run_id, request_id)]["predicted"][(tag, int(layer))] = float(predicted)
    return [s for s in samples.values() if s["predicted"]]


def weighted_quantile(values: list[float], weights: list[float], q: float) -> float:
    """The smallest value whose cumulative weight reaches `q` of the total."""
    pairs = sorted(zip(values, weights, strict=True))
    total = sum(weights)
    running = 0.0
    for value, weight in pairs:
        running += weight
        if running >= q * total - 1e-15:
            return value
    return pairs[-1][0]


def fit(samples: list[dict[str, Any]], quantile: float) -> dict[tuple[str, int], tuple[float, int]]:
    """(tag, layer) -> (ratio measured / predicted, number of requests)."""
    ratios: dict[tuple[str, int], tuple[list[float], list[float]]] = {}
    for sample in samples:
        total = sum(sample["predicted"].values())
        ratio = sample["measured"] / total
        for key, predicted in sample["predicted"].items():
            values, weights = ratios.setdefault(key, ([], []))
            values.append(ratio)
            weights.append(predicted / total)
    return {key: (weighted_quantile(v, w, quantile), len(v)) for key, (v, w) in ratios.items()}


@dataclasses.dataclass(frozen=True, slots=True)
class FittedScale:
    """One (tag, layer)'s new scale: the scale in force times the quantile of measured / predicted."""

    tag: Tag
    layer: int
    ratio: float  # the fitted quantile of measured / predicted
    scale: float  # the new scale
    num_requests: int  # requests the (tag, layer) appears in


@dataclasses.dataclass(frozen=True, slots=True)
class CalibrationFit:
    """A fit over the audited requests of some runs (no scales when none had approximate events)."""

    num_requests: int
    run_ids: list[int]
    scales: list[FittedScale]


def fit_calibration(ledger: Ledger, run_ids: list[int], quantile: float) -> CalibrationFit:
    """Fit new scales for the calibrated tags from the audited requests of `run_ids` (all runs when empty)."""
    samples = request_samples(ledger, run_ids)
    if not samples:
        return CalibrationFit(0, [], [])
    current = load_calibration(ledger)
    scales = [
        FittedScale(Tag(tag), layer, ratio, max(MIN_SCALE, current.scale(Tag(tag), layer) * ratio), count)
        for (tag, layer), (ratio, count) in sorted(fit(samples, quantile).items())
        if Tag(tag) in CALIBRATED_TAGS
    ]
    return CalibrationFit(len(samples), sorted({s["run_id"] for s in samples}), scales)


def store_calibration(ledger: Ledger, fitted: CalibrationFit) -> None:
    """Write the fitted scales to the ledger's ``calibrations`` table (later runs load them)."""
    writer = LedgerWriter(ledger)
    for scale in fitted.scales:
        writer.record_calibration(scale.tag.value, scale.layer, scale.scale, scale.num_requests, fitted.run_ids)
    writer.close()

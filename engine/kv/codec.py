"""Quantized KV block copies (KIVI layout: keys per channel, values per token) and their disk form.

Disk form: six raw files per block (key codes, scales, zero points; then the values'), codes as held in
memory (int4 packed two per byte along the last axis), each file's dtype and shape in its SpillRecord and
each part's (bits, axis, group_size, original shape) in `QuantKV.meta`. Spill files live only as long as
the SpillDir that wrote them (one process), so no older layout is ever read back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import xxhash

from fallbackgate.engine.errors import EngineError
from fallbackgate.engine.experts.quant import (
    Quantized,
    dequantize,
    quantize,
    quantized_nbytes,
    quantized_to,
    unpacked_codes,
)
from fallbackgate.engine.kv.spill import SpillDir, SpillRecord


@dataclasses.dataclass(slots=True)
class QuantKV:
    """A block's K and V quantized; `records` is set when the copy lives on disk."""

    keys: Quantized | None  # None while on disk
    values: Quantized | None
    bits: int
    nbytes: int  # storage bytes of codes + scales + zero points
    records: tuple[SpillRecord, ...] = ()  # disk files: k codes/scales/zeros, v codes/scales/zeros
    meta: tuple[tuple[int, int, int, tuple[int, ...]], ...] = ()  # (bits, axis, group_size, shape) of K, V on disk

    @property
    def num_bytes(self) -> int:
        return self.nbytes


def _kv_parts(block_shape: Sequence[int], key_dim: int) -> tuple[tuple[tuple[int, ...], int, int], ...]:
    """(shape, axis, group_size) of the K and V parts of a [kv_heads, block_size, key_dim + value_dim] block:
    keys grouped over tokens (per channel), values over channels (per token)."""
    heads, block_size, width = block_shape
    value_dim = width - key_dim
    return ((heads, block_size, key_dim), 1, block_size), ((heads, block_size, value_dim), 2, min(32, value_dim))


def quant_kv_nbytes(block_shape: Sequence[int], bits: int, key_dim: int) -> int:
    """Storage bytes of `quantize_kv` of a `block_shape` block at `bits` (codes, scales, zero points as held)."""
    return sum(quantized_nbytes(shape, bits, axis, group) for shape, axis, group in _kv_parts(block_shape, key_dim))


def quantize_kv(block: torch.Tensor, bits: int, key_dim: int) -> QuantKV:
    """Quantize a [kv_heads, block_size, key_dim + value_dim] block: K per channel, V per token."""
    (_, key_axis, key_group), (_, value_axis, value_group) = _kv_parts(block.shape, key_dim)
    keys = quantize(block[..., :key_dim], bits, axis=key_axis, group_size=key_group)
    values = quantize(block[..., key_dim:], bits, axis=value_axis, group_size=value_group)
    return QuantKV(keys, values, bits, keys.num_bytes + values.num_bytes)


def dequantize_kv(quant: QuantKV) -> torch.Tensor:
    """Back to a [kv_heads, block_size, key_dim + value_dim] fp32 block."""
    assert quant.keys is not None and quant.values is not None
    return torch.cat([dequantize(quant.keys), dequantize(quant.values)], dim=-1)


def codes_checksum(keys: torch.Tensor, values: torch.Tensor) -> int:
    """xxh3-64 of a block's integer codes, one per byte (K then V, each in its tensor's shape and C order):
    what the ledger records of a quantized copy served, and what the replay checks its own codes against.
    Scales and zero points are floats and are not hashed (the replay's differ from the served ones by
    rounding); a code is a small integer, reproduced exactly unless its value lay at a rounding boundary."""
    digest = xxhash.xxh3_64()
    for codes in (keys, values):
        digest.update(codes.detach().to("cpu", torch.uint8).contiguous().numpy().tobytes())
    return digest.intdigest()


def quant_checksum(quant: QuantKV) -> int:
    """:func:`codes_checksum` of a quantized block held in memory."""
    assert quant.keys is not None and quant.values is not None
    return codes_checksum(unpacked_codes(quant.keys), unpacked_codes(quant.values))


def write_quant(spill: SpillDir, name: str, quant: QuantKV) -> QuantKV:
    """Put a quantized block on disk; the returned copy holds only records."""
    records: list[SpillRecord] = []
    meta = []
    for label, part in (("k", quant.keys), ("v", quant.values)):
        assert part is not None
        records += [
            spill.write(f"{name}-{label}c", part.codes),
            spill.write(f"{name}-{label}s", part.scales),
            spill.write(f"{name}-{label}z", part.zeros),
        ]
        meta.append((part.bits, part.axis, part.group_size, part.shape))
    return QuantKV(None, None, quant.bits, quant.nbytes, tuple(records), tuple(meta))


def read_quant(spill: SpillDir, quant: QuantKV) -> QuantKV:
    """Read a disk-resident quantized block back (checksums verified)."""
    parts = []
    pending = [spill.submit_read(r) for r in quant.records]  # all six in flight together, then each verified
    for i, (bits, axis, group_size, shape) in enumerate(quant.meta):
        codes, scales, zeros = (spill.finish_read(p) for p in pending[3 * i : 3 * i + 3])
        part = Quantized(codes, scales, zeros, bits, axis, group_size, shape)
        if part.num_bytes != quantized_nbytes(shape, bits, axis, group_size):
            raise EngineError(f"{quant.records[3 * i].path.name}: {part.num_bytes} B read, not a {bits}-bit {shape}")
        parts.append(part)
    return QuantKV(parts[0], parts[1], quant.bits, quant.nbytes)


def quant_to(quant: QuantKV, device: torch.device) -> QuantKV:
    """The same quantized block with codes, scales and zero points on `device`."""
    assert quant.keys is not None and quant.values is not None
    return QuantKV(quantized_to(quant.keys, device), quantized_to(quant.values, device), quant.bits, quant.nbytes)


def relative_error_energy(quant: QuantKV) -> float | None:
    """Relative error energy ‖x − Q(x)‖² / ‖x‖² of a quantized copy, estimated from its group scales (uniform
    rounding error: scale² / 12 per element); None while its codes are on disk."""
    if quant.keys is None or quant.values is None:
        return None
    restored = dequantize_kv(quant)
    signal = float(restored.pow(2).sum())
    noise = sum(float(q.scales.pow(2).sum()) * q.group_size / 12.0 for q in (quant.keys, quant.values))
    return noise / signal if signal > 0 else 0.0

"""Group-wise integer quantization (int8 / int4) with per-group scales and zero points, and the storage bytes
of every copy the engine keeps (full and quantized) — the one place that byte math is done.

KV follows KIVI: keys are quantized per channel (groups run along the token axis), values per token
(groups run along the channel axis). Experts use per-output-row groups. int4 codes are packed two per byte
along the last axis (low nibble first, an odd row padded with one zero nibble), so the bytes a copy is
counted for are the bytes it holds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

DEFAULT_GROUP_SIZE = 32  # elements per group of an expert's low-bit copy (along each output row)
SCALE_DTYPE = torch.float32  # scales and zero points are kept in fp32 whatever the tensor's dtype
PADDED_BUFFERS = 4  # fp32 buffers of its rows `dequantize` holds at once for a padded last group


@dataclasses.dataclass(slots=True)
class Quantized:
    """An asymmetric group-quantized tensor of shape `shape`: uint8 `codes` (int8: one per byte, same shape;
    int4: two per byte along the last axis, `shape[:-1] + (ceil(shape[-1] / 2),)`), fp32 scale and minimum
    per group."""

    codes: torch.Tensor  # uint8 codes, packed for int4 (see above)
    scales: torch.Tensor  # fp32 scale per group
    zeros: torch.Tensor  # fp32 minimum per group
    bits: int  # 8 or 4
    axis: int  # the axis along which groups are formed
    group_size: int  # elements per group along `axis`
    shape: tuple[int, ...]  # shape of the original tensor

    @property
    def num_bytes(self) -> int:
        """Storage bytes of codes, scales and zero points as held."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.zeros))


def full_nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Storage bytes of a full-precision copy of a `shape` tensor in `dtype`."""
    return math.prod(shape) * dtype.itemsize


def quantized_nbytes(shape: Sequence[int], bits: int, axis: int, group_size: int) -> int:
    """Storage bytes `quantize(x, bits, axis, group_size)` holds for a `shape` tensor: codes (int4 packed two
    per byte along the last axis) plus one fp32 scale and one fp32 zero point per group."""
    shape = tuple(shape)
    if bits == 8:
        code_bytes = math.prod(shape)
    elif bits == 4:
        code_bytes = math.prod(shape[:-1]) * -(-shape[-1] // 2)
    else:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    length = shape[axis]
    num_groups = math.prod(shape) // length * -(-length // group_size) if length else 0
    return code_bytes + 2 * num_groups * SCALE_DTYPE.itemsize


def lowbit_expert_nbytes(matrix_shapes: Sequence[Sequence[int]], bits: int) -> int:
    """Storage bytes of an expert's low-bit copy: each matrix quantized per output row (`quantize(m, bits,
    axis=1)`, groups of DEFAULT_GROUP_SIZE)."""
    return sum(quantized_nbytes(shape, bits, 1, DEFAULT_GROUP_SIZE) for shape in matrix_shapes)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes in 0..15 packed two per byte along the last axis (even index in the low nibble)."""
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return _compact(codes[..., 0::2] | (codes[..., 1::2] << 4))


def unpack_int4(packed: torch.Tensor, length: int) -> torch.Tensor:
    """The inverse of `pack_int4` for a last axis of `length` codes."""
    both = torch.stack((packed & 0x0F, packed >> 4), dim=-1)
    return both.reshape(*packed.shape[:-1], -1)[..., :length]


def unpacked_codes(q: Quantized) -> torch.Tensor:
    """`q`'s codes one per byte, in the original tensor's shape."""
    return unpack_int4(q.codes, q.shape[-1]) if q.bits == 4 else q.codes


def _compact(t: torch.Tensor) -> torch.Tensor:
    """`t` in a contiguous storage of exactly its own bytes (`contiguous()` keeps a padded storage alive when
    the sliced dimensions have size 1)."""
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)


def quantize(x: torch.Tensor, bits: int, axis: int, group_size: int = DEFAULT_GROUP_SIZE) -> Quantized:
    """Quantize `x` with groups of `group_size` along `axis` (min/max asymmetric)."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    moved = x.detach().float().movedim(axis, -1)
    length = moved.shape[-1]
    pad = (-length) % group_size
    if pad:
        moved = torch.nn.functional.pad(moved, (0, pad), value=float(moved[..., -1:].mean()))
    grouped = moved.reshape(*moved.shape[:-1], -1, group_size)
    low = grouped.amin(dim=-1, keepdim=True)
    high = grouped.amax(dim=-1, keepdim=True)
    levels = (1 << bits) - 1
    scales = ((high - low) / levels).clamp_min(1e-12)
    codes = torch.round((grouped - low) / scales).clamp(0, levels).to(torch.uint8)
    codes = codes.reshape(*moved.shape[:-1], -1)[..., :length].movedim(-1, axis)
    codes = pack_int4(codes) if bits == 4 else _compact(codes)
    return Quantized(
        codes=codes,
        scales=scales.squeeze(-1),
        zeros=low.squeeze(-1),
        bits=bits,
        axis=axis,
        group_size=group_size,
        shape=tuple(x.shape),
    )


def dequantize(q: Quantized) -> torch.Tensor:
    """Reconstruct an fp32 tensor from `q`."""
    codes = unpacked_codes(q).movedim(q.axis, -1).float()
    length = codes.shape[-1]
    pad = (-length) % q.group_size
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    grouped = codes.reshape(*codes.shape[:-1], -1, q.group_size)
    values = grouped * q.scales.unsqueeze(-1) + q.zeros.unsqueeze(-1)
    return values.reshape(*codes.shape[:-1], -1)[..., :length].movedim(-1, q.axis).contiguous()


def dequantize_rows(q: Quantized, dtype: torch.dtype, num_rows: int = 64) -> torch.Tensor:
    """`dequantize(q).to(dtype)` for a 2-D tensor grouped along its last axis, `num_rows` rows at a time,
    so the fp32 working set is one buffer of `num_rows` rows rather than the whole tensor (same values, same
    rounding: each code times its group's scale, plus its minimum, in fp32, then rounded to `dtype`)."""
    if len(q.shape) != 2 or q.axis != 1:
        return dequantize(q).to(dtype)
    num_total_rows, length = q.shape
    if length % q.group_size:  # a padded last group: the general path, chunk by chunk
        return _dequantize_padded_rows(q, dtype, num_rows)
    out = torch.empty(q.shape, dtype=dtype, device=q.codes.device)
    for start in range(0, num_total_rows, num_rows):
        rows = slice(start, start + num_rows)
        codes = q.codes[rows]
        values = (unpack_int4(codes, length) if q.bits == 4 else codes).float()
        grouped = values.view(values.shape[0], -1, q.group_size)
        grouped.mul_(q.scales[rows].unsqueeze(-1)).add_(q.zeros[rows].unsqueeze(-1))
        out[rows] = values
    return out


def _dequantize_padded_rows(q: Quantized, dtype: torch.dtype, num_rows: int) -> torch.Tensor:
    """:func:`dequantize_rows` for rows whose last group is padded: :func:`dequantize` holds up to four
    fp32 buffers of the rows it takes (padded codes, scaled, shifted, unpadded copy), so it takes a quarter of
    `num_rows` at a time and the working set stays one buffer of `num_rows` rows."""
    out = torch.empty(q.shape, dtype=dtype, device=q.codes.device)
    num_rows = max(1, num_rows // PADDED_BUFFERS)
    for start in range(0, q.shape[0], num_rows):
        rows = slice(start, start + num_rows)
        num_chunk_rows = min(num_rows, q.shape[0] - start)
        chunk = dataclasses.replace(
            q, codes=q.codes[rows], scales=q.scales[rows], zeros=q.zeros[rows], shape=(num_chunk_rows, q.shape[1])
        )
        out[rows] = dequantize(chunk)
    return out


def dequant_chunk_rows(shape: Sequence[int], min_numel: int, max_numel: int) -> int:
    """Rows :func:`dequantize_rows` takes at a time for a `shape` matrix: a quarter of it, kept between
    `min_numel` and `max_numel` elements (at least one row), so its fp32 working set is small beside the
    matrix and each chunk is large enough for its few tensor operations to pay."""
    num_cols = shape[-1] if len(shape) else 1  # only a 2-D matrix is chunked; any other shape gets a number
    num_rows = math.prod(shape) // max(1, num_cols)
    numel = min(max_numel, max(min_numel, num_rows * num_cols // 4))
    return max(1, numel // max(1, num_cols))


def quantized_to(q: Quantized, device: torch.device) -> Quantized:
    """`q` with its tensors on `device` (a no-op when they are already there)."""
    return dataclasses.replace(q, codes=q.codes.to(device), scales=q.scales.to(device), zeros=q.zeros.to(device))

"""Group-wise integer quantization (int8 / int4) with per-group scales and zero points.

KV follows KIVI: keys are quantized per channel (groups run along the token axis), values per token
(groups run along the channel axis). Experts use per-output-row groups.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(slots=True)
class Quantized:
    """An asymmetric group-quantized tensor; `codes` holds one value per byte (int4 uses 0..15)."""

    codes: torch.Tensor  # uint8 codes, same shape as the original
    scales: torch.Tensor  # fp32 scale per group
    zeros: torch.Tensor  # fp32 minimum per group
    bits: int  # 8 or 4
    axis: int  # the axis along which groups are formed
    group_size: int  # elements per group along `axis`

    @property
    def num_bytes(self) -> int:
        """Storage bytes: int4 codes count half a byte each (packed two per byte on a real device)."""
        code_bytes = self.codes.numel() if self.bits == 8 else (self.codes.numel() + 1) // 2
        return code_bytes + 4 * (self.scales.numel() + self.zeros.numel())


def quantize(x: torch.Tensor, bits: int, axis: int, group_size: int = 32) -> Quantized:
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
    codes = codes.reshape(*moved.shape[:-1], -1)[..., :length].movedim(-1, axis).contiguous()
    return Quantized(
        codes=codes, scales=scales.squeeze(-1), zeros=low.squeeze(-1), bits=bits, axis=axis, group_size=group_size
    )


def dequantize(q: Quantized) -> torch.Tensor:
    """Reconstruct an fp32 tensor from `q`."""
    codes = q.codes.movedim(q.axis, -1).float()
    length = codes.shape[-1]
    pad = (-length) % q.group_size
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    grouped = codes.reshape(*codes.shape[:-1], -1, q.group_size)
    values = grouped * q.scales.unsqueeze(-1) + q.zeros.unsqueeze(-1)
    return values.reshape(*codes.shape[:-1], -1)[..., :length].movedim(-1, q.axis).contiguous()


def dequantize_rows(q: Quantized, dtype: torch.dtype, num_rows: int = 64) -> torch.Tensor:
    """`dequantize(q).to(dtype)` for a 2-D tensor grouped along its last axis, `num_rows` rows at a time,
    so the fp32 working set is `num_rows` rows rather than the whole tensor (same values, same rounding)."""
    if q.codes.dim() != 2 or q.axis != 1:
        return dequantize(q).to(dtype)
    out = torch.empty(q.codes.shape, dtype=dtype, device=q.codes.device)
    for start in range(0, q.codes.shape[0], num_rows):
        rows = slice(start, start + num_rows)
        out[rows] = dequantize(dataclasses.replace(q, codes=q.codes[rows], scales=q.scales[rows], zeros=q.zeros[rows]))
    return out


def quantized_to(q: Quantized, device: torch.device) -> Quantized:
    """`q` with its tensors on `device` (a no-op when they are already there)."""
    return dataclasses.replace(q, codes=q.codes.to(device), scales=q.scales.to(device), zeros=q.zeros.to(device))

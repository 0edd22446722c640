"""FP8 experts held as the checkpoint stores them and dequantized per expert on use.

A block-scaled FP8 expert (DeepSeek-V3, Qwen3-FP8 as published) stays e4m3 codes and float32 block scales
in host memory (`BlockScaled`: about half a bf16 copy); when it is used it is dequantized straight into a
compute-dtype destination (a device slot for the grouped kernel, or a fresh copy for cpu_execute and the
low-bit maker), one block row of each part at a time. Each element is transformers' ``Fp8Dequantize``
arithmetic (`fp8.dequantize`: codes and scale in float32, multiplied, cast), so the result is bitwise the
dequantize-on-read weights; the chunk's temporaries are the staging that `scratch_bytes` counts.
"""

from __future__ import annotations

import torch

from fallbackgate.engine.experts.weights import BlockScaled, ExpertWeights, HeldWeights
from fallbackgate.engine.model import fp8

# bytes per element of one chunk's temporaries: the codes moved to the destination's device (1), their
# float32 copy (4), the float32 product (4) and its cast to the compute dtype (itemsize)
_TEMPORARY_BYTES_PER_CODE = 1 + 4 + 4


def _parts(held: BlockScaled) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(codes, scales) of gate, up and down."""
    gate_rows = held.gate_up.shape[0] // 2
    codes = (held.gate_up[:gate_rows], held.gate_up[gate_rows:], held.down)
    return list(zip(codes, held.scales, strict=True))


def _block_rows(codes: torch.Tensor, scales: torch.Tensor) -> int:
    return codes.shape[0] // (scales.shape[0] if scales.dim() >= 2 else 1)


def dequantize_into(dest: ExpertWeights, held: BlockScaled) -> None:
    """Write `held` dequantized into `dest` (compute dtype, on any device), one block row at a time."""
    gate_rows = held.gate_up.shape[0] // 2
    targets = (dest.gate_up[:gate_rows], dest.gate_up[gate_rows:], dest.down)
    for target, (codes, scales) in zip(targets, _parts(held), strict=True):
        if scales.dim() < 2:  # one scale for the whole matrix
            target.copy_(fp8.dequantize(codes.to(target.device), scales.to(target.device), target.dtype))
            continue
        step = _block_rows(codes, scales)
        for block, row in enumerate(range(0, codes.shape[0], step)):
            chunk = codes[row : row + step].to(target.device, non_blocking=True)
            block_scales = scales[block : block + 1].to(target.device, non_blocking=True)
            target[row : row + step].copy_(fp8.dequantize(chunk, block_scales, target.dtype))


def to_compute(held: HeldWeights, dtype: torch.dtype) -> ExpertWeights:
    """A compute-dtype copy of `held` in fresh host memory (an ExpertWeights in `dtype` is returned as is)."""
    if isinstance(held, ExpertWeights):
        return held
    dest = ExpertWeights(torch.empty(held.gate_up.shape, dtype=dtype), torch.empty(held.down.shape, dtype=dtype))
    dequantize_into(dest, held)
    return dest


def write_into(dest: ExpertWeights, held: HeldWeights) -> None:
    """Fill the slot `dest` from a held copy: a plain copy, or FP8 dequantized block row by block row."""
    if isinstance(held, BlockScaled):
        dequantize_into(dest, held)
    else:
        dest.gate_up.copy_(held.gate_up, non_blocking=True)
        dest.down.copy_(held.down, non_blocking=True)


def scratch_bytes(matrix_shapes: tuple[tuple[int, int], tuple[int, int]], block_rows: int, dtype: torch.dtype) -> int:
    """Peak bytes of `dequantize_into`'s temporaries: the largest part's one block row of codes, in float32
    twice and in `dtype` once."""
    cols = max(c for _, c in matrix_shapes)
    return min(block_rows, max(r for r, _ in matrix_shapes)) * cols * (_TEMPORARY_BYTES_PER_CODE + dtype.itemsize)

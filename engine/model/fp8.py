"""Block-scaled FP8 weights as DeepSeek-V3 and Qwen3-FP8 publish them: e4m3 codes with a float32
``weight_scale_inv`` per block (128 × 128), dequantized the way transformers dequantizes them.

transformers loads such a checkpoint on a machine without an FP8 GPU by dequantizing every weight once
(``Fp8Dequantize``: codes and scales to float32, multiplied blockwise, cast to the parameter's dtype). The
engine does the same arithmetic, per dense tensor at load and per routed expert each time it is used (its
host copy stays FP8: `engine/experts/fp8_experts.py`), so its weights are bitwise those transformers
computes; what streams from disk and sits in the host cache is the FP8 bytes.
"""

from __future__ import annotations

import torch

from fallbackgate.engine.errors import CheckpointError

SCALE_SUFFIX = "_scale_inv"  # `X.weight` is scaled by `X.weight_scale_inv`
FP8_DTYPES: dict[str, torch.dtype] = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
DEFAULT_COMPUTE_DTYPE = torch.bfloat16  # when an FP8 checkpoint's config names no dtype


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether `dtype` is one of the FP8 formats checkpoints ship."""
    return dtype in FP8_DTYPES.values()


def scale_name(weight_name: str) -> str:
    """The scale tensor's name for weight tensor `weight_name`."""
    return weight_name + SCALE_SUFFIX


def is_scale_tensor(name: str) -> bool:
    """Whether tensor `name` holds block scales (of the weight named without the suffix)."""
    return name.endswith(SCALE_SUFFIX)


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, name: str = "") -> torch.Tensor:
    """`weight` (FP8 codes, [..., rows, cols]) times its per-block `scale_inv` ([..., rows/bm, cols/bn]),
    in float32, cast to `dtype`: transformers' ``Fp8Dequantize`` arithmetic, so bitwise its result."""
    rows, cols = weight.shape[-2:]
    scale_rows, scale_cols = (1, 1) if scale_inv.dim() < 2 else scale_inv.shape[-2:]
    if rows % scale_rows or cols % scale_cols:
        raise CheckpointError(
            f"tensor {name}: FP8 weight [{rows}, {cols}] does not tile into its scale grid [{scale_rows}, {scale_cols}]"
        )
    block_rows, block_cols = rows // scale_rows, cols // scale_cols
    codes = weight.to(torch.float32).reshape(-1, scale_rows, block_rows, scale_cols, block_cols)
    scales = scale_inv.to(torch.float32).reshape(-1, scale_rows, scale_cols).unsqueeze(-1).unsqueeze(2)
    return (codes * scales).to(dtype).reshape(weight.shape)


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes, float32 scale_inv) of `weight` by max-abs per block, as transformers' ``Fp8Quantize``
    makes them; used to write FP8 test checkpoints. Rows and columns must be multiples of the block."""
    rows, cols = weight.shape
    block_rows, block_cols = block
    if rows % block_rows or cols % block_cols:
        raise ValueError(f"[{rows}, {cols}] is not a multiple of the {block} block")
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    tiles = weight.to(torch.float32).reshape(rows // block_rows, block_rows, cols // block_cols, block_cols)
    max_abs = tiles.abs().amax(dim=(1, 3))
    scales = torch.where(max_abs > 0, fp8_max / torch.where(max_abs > 0, max_abs, 1.0), 1.0)
    codes = (tiles * scales[:, None, :, None]).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
    return codes.reshape(rows, cols), (1.0 / scales).to(torch.float32)

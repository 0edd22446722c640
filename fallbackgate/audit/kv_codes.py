"""The integer codes of a KV block as served, rebuilt from the replay's own K/V and checked against the
checksum the engine recorded when it wrote the quantized copy (``kv_copies.code_checksums``).

The replay's K/V equal the served K/V only to float rounding (other kernel shapes), so re-quantizing them
gives the served codes except where a value lay within rounding noise of a code boundary: there the code
may land on the other neighbour. Such codes are few; the rebuild tries the codes nearest a boundary on
their other side (one, then two at a time) until the codes' checksum equals the recorded one, and the
replay dequantizes those codes with its own scales and zero points. A code that is wrong by more than
rounding noise (a codec bug, a corrupted copy) matches no candidate: :class:`KVCodesError` then, a
correctness failure of the request. Ledgers written before the checksums were recorded get the plain
re-quantization (what the replay did before).
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from fallbackgate.audit.replay_trace import TraceError
from fallbackgate.engine.experts.quant import Quantized, dequantize, unpacked_codes
from fallbackgate.engine.kv.codec import codes_checksum, dequantize_kv, quantize_kv

# a code whose value lay this close (in code units) to a rounding boundary may flip: 2x the largest margin a
# correct run needed (0.0087 code units, the mixed workload under the demo budget; most flips lie under 1e-4)
BOUNDARY_TOLERANCE = 0.02
MAX_SINGLE = 64  # codes nearest a boundary tried one at a time
MAX_PAIRS = 16  # ... and two at a time among the nearest of them


class KVCodesError(TraceError):
    """The served codes of a KV block are not a re-quantization of the replay's K/V."""


def _margins(x: torch.Tensor, q: Quantized) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per element of `x` quantized as `q`: its code (one per byte), its distance in code units from the
    nearest rounding boundary, and the code on the boundary's other side (clamped to the code range)."""
    codes = unpacked_codes(q)
    plain = dataclasses.replace(q, codes=codes, bits=8)  # one code per byte: dequantize reads them as they are
    zero_codes = dataclasses.replace(plain, codes=torch.zeros_like(codes))
    step = dequantize(dataclasses.replace(plain, codes=torch.ones_like(codes))) - dequantize(zero_codes)
    offset = (x.float() - dequantize(plain)) / step.clamp_min(1e-30)  # in code units, about [-0.5, 0.5]
    levels = (1 << q.bits) - 1
    other = (codes.to(torch.int16) + torch.where(offset >= 0, 1, -1)).clamp(0, levels).to(torch.uint8)
    return codes, 0.5 - offset.abs(), other


def _candidates(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> list[tuple[int, int]]:
    """(part, flat index) of the codes nearest a boundary that can flip, nearest first."""
    found: list[tuple[float, int, int]] = []
    for p, (codes, margin, other) in enumerate(parts):
        near = torch.nonzero(((margin < BOUNDARY_TOLERANCE) & (other != codes)).flatten()).flatten()
        found += [(float(margin.flatten()[i]), p, int(i)) for i in near]
    return [(p, i) for _, p, i in sorted(found)[:MAX_SINGLE]]


def _search(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], checksum: int) -> list[torch.Tensor] | None:
    """The codes of both parts whose checksum is `checksum`: the replay's own, or with one or two codes
    near a boundary flipped; None when none matches."""
    base = [codes for codes, _, _ in parts]
    if codes_checksum(*base) == checksum:
        return base
    near = _candidates(parts)
    flips = itertools.chain(((c,) for c in near), itertools.combinations(near[:MAX_PAIRS], 2))
    for flip in flips:
        trial = [codes.clone() for codes in base]
        for p, i in flip:
            trial[p].view(-1)[i] = parts[p][2].reshape(-1)[i]
        if codes_checksum(*trial) == checksum:
            return trial
    return None


def served_round_trip(packed: torch.Tensor, bits: int, key_dim: int, checksum: int | None, where: str) -> torch.Tensor:
    """A [kv_heads, tokens, key_dim + value_dim] block as the served copy's codes give it back: quantized
    from the replay's K/V `packed`, its codes rebuilt to match `checksum` (see the module docstring), then
    dequantized. `where` names the block in the error."""
    quant = quantize_kv(packed, bits, key_dim)
    if checksum is None:
        return dequantize_kv(quant)
    assert quant.keys is not None and quant.values is not None
    parts = [_margins(packed[..., :key_dim], quant.keys), _margins(packed[..., key_dim:], quant.values)]
    codes = _search(parts, checksum)
    if codes is None:
        raise KVCodesError(
            f"{where}: the served int{bits} codes (xxh3-64 {checksum:016x}) are not a re-quantization of the "
            "replay's K/V (no code within rounding noise of a boundary gives them): the kv_dequant copy served "
            "was not the block's quantized K/V"
        )
    restored = [
        dequantize(dataclasses.replace(q, codes=c, bits=8))
        for q, c in zip((quant.keys, quant.values), codes, strict=True)
    ]
    return torch.cat(restored, dim=-1)

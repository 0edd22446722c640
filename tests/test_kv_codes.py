"""The replay rebuilds the served codes of a quantized KV block from its own K/V and the recorded checksum:
codes at a rounding boundary may flip (float noise), any other difference is a served copy that was not
the block's quantized K/V."""

from __future__ import annotations

import pytest
import torch

from fallbackgate.audit.kv_codes import KVCodesError, served_round_trip
from fallbackgate.engine.experts.quant import unpacked_codes
from fallbackgate.engine.kv.codec import codes_checksum, dequantize_kv, quant_checksum, quantize_kv

KEY_DIM = 8


def _block(seed: int = 0) -> torch.Tensor:
    return torch.randn(2, 16, 2 * KEY_DIM, generator=torch.Generator().manual_seed(seed))


def _at_boundary(block: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`block` with one value moved onto a rounding boundary (served) and just past it (the replay's)."""
    quant = quantize_kv(block, bits, KEY_DIM)
    assert quant.keys is not None
    low, scale = quant.keys.zeros[0, 0], quant.keys.scales[0, 0]  # keys grouped over tokens: head 0, channel 0
    code = int(unpacked_codes(quant.keys)[0, 1, 0])  # token 1, likely neither the min nor the max
    boundary = low + (code + 0.5) * scale
    served, replay = block.clone(), block.clone()
    served[0, 1, 0] = boundary - 1e-5 * scale
    replay[0, 1, 0] = boundary + 1e-5 * scale
    return served, replay


@pytest.mark.parametrize("bits", [8, 4])
def test_a_code_flipped_by_rounding_noise_is_rebuilt(bits: int) -> None:
    served, replay = _at_boundary(_block(), bits)
    served_quant = quantize_kv(served, bits, KEY_DIM)
    replay_quant = quantize_kv(replay, bits, KEY_DIM)
    assert quant_checksum(replay_quant) != quant_checksum(served_quant)  # the flip the replay must undo
    restored = served_round_trip(replay, bits, KEY_DIM, quant_checksum(served_quant), "block")
    assert torch.allclose(restored, dequantize_kv(served_quant), atol=1e-5)
    assert not torch.allclose(dequantize_kv(replay_quant), dequantize_kv(served_quant), atol=1e-5)


def test_equal_codes_dequantize_as_the_codec_does() -> None:
    block = _block(1)
    quant = quantize_kv(block, 8, KEY_DIM)
    assert torch.equal(served_round_trip(block, 8, KEY_DIM, quant_checksum(quant), "b"), dequantize_kv(quant))
    assert torch.equal(served_round_trip(block, 8, KEY_DIM, None, "b"), dequantize_kv(quant))  # older ledgers


@pytest.mark.parametrize("bits", [8, 4])
def test_a_wrong_code_is_caught(bits: int) -> None:
    block = _block(2)
    quant = quantize_kv(block, bits, KEY_DIM)
    assert quant.keys is not None and quant.values is not None
    keys, values = unpacked_codes(quant.keys).clone(), unpacked_codes(quant.values)
    keys[1, 3, 2] = (int(keys[1, 3, 2]) + 2) % (1 << bits)  # two codes away: no rounding noise does that
    with pytest.raises(KVCodesError, match="step 3, layer 1, KV block 0: the served int"):
        served_round_trip(block, bits, KEY_DIM, codes_checksum(keys, values), "step 3, layer 1, KV block 0")

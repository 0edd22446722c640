"""Bytes by dtype: every quantized copy is counted for the bytes it holds, in every dtype (fp32, bf16, fp16, and
fp8 e4m3 for the codec), at 8 and 4 bits.

The counted bytes (`num_bytes`, the formulas in `engine/experts/quant.py` / `engine/kv/codec.py`, and what
the host pool reserves) are compared with the storages of the tensors really held, deduplicated by storage;
int4 codes are packed two per byte and dequantize to exactly the values of the former one-code-per-byte form.
An FP8-held expert (e4m3 codes + fp32 block scales) is counted at those storages.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fallbackgate.engine.device_pool import TierPool
from fallbackgate.engine.experts import fp8_experts
from fallbackgate.engine.experts.quant import (
    Quantized,
    dequantize,
    dequantize_rows,
    lowbit_expert_nbytes,
    pack_int4,
    quantize,
    quantized_nbytes,
    unpack_int4,
    unpacked_codes,
)
from fallbackgate.engine.experts.weights import BlockScaled, ExpertWeights
from fallbackgate.engine.kv.codec import dequantize_kv, quant_kv_nbytes, quantize_kv, read_quant, write_quant
from fallbackgate.engine.kv.spill import SpillDir
from fallbackgate.engine.kv.store import KVStore, SpillMode
from fallbackgate.engine.model import fp8
from fallbackgate.engine.tags import ObjectKind

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# FP8 (e4m3, as FP8 checkpoints store weights) where this torch has it: the codec reads any float dtype
WEIGHT_DTYPES = DTYPES + ((torch.float8_e4m3fn,) if hasattr(torch, "float8_e4m3fn") else ())
FAST = settings(max_examples=50, deadline=None)


def storage_bytes(*tensors: torch.Tensor) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`torch.equal` by bits (FP8 tensors have no comparison kernels)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else torch.equal(a, b)


def held_bytes(q: Quantized) -> int:
    return storage_bytes(q.codes, q.scales, q.zeros)


def former_codes_and_values(x: torch.Tensor, bits: int, axis: int, group_size: int) -> tuple[torch.Tensor, ...]:
    """The former codec, verbatim: codes one per byte in the tensor's shape, and `dequantize` of them."""
    moved = x.detach().float().movedim(axis, -1)
    length = moved.shape[-1]
    pad = (-length) % group_size
    if pad:
        moved = torch.nn.functional.pad(moved, (0, pad), value=float(moved[..., -1:].mean()))
    grouped = moved.reshape(*moved.shape[:-1], -1, group_size)
    low, high = grouped.amin(dim=-1, keepdim=True), grouped.amax(dim=-1, keepdim=True)
    scales = ((high - low) / ((1 << bits) - 1)).clamp_min(1e-12)
    codes = torch.round((grouped - low) / scales).clamp(0, (1 << bits) - 1).to(torch.uint8)
    codes = codes.reshape(*moved.shape[:-1], -1)[..., :length].movedim(-1, axis).contiguous()
    floats = codes.movedim(axis, -1).float()  # the former dequantize from here on
    if pad:
        floats = torch.nn.functional.pad(floats, (0, pad))
    values = floats.reshape(*floats.shape[:-1], -1, group_size) * scales + low
    return codes, values.reshape(*floats.shape[:-1], -1)[..., :length].movedim(-1, axis).contiguous()


matrices = st.tuples(st.integers(1, 9), st.integers(1, 70))
group_sizes = st.sampled_from((3, 5, 7, 16, 32))


@FAST
@given(
    st.sampled_from(WEIGHT_DTYPES), st.sampled_from((8, 4)), matrices, group_sizes, st.integers(0, 2**16),
    st.integers(1, 12),
)  # fmt: skip
def test_an_expert_matrix_copy_holds_the_bytes_it_is_counted_for(
    dtype, bits, shape, group_size, seed, num_chunk_rows
) -> None:
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)
    q = quantize(x, bits, axis=1, group_size=group_size)
    assert q.num_bytes == quantized_nbytes(shape, bits, 1, group_size) == held_bytes(q)
    rows, cols = shape
    assert q.codes.numel() == (rows * cols if bits == 8 else rows * -(-cols // 2))  # int4: two codes per byte
    codes, values = former_codes_and_values(x, bits, 1, group_size)
    assert torch.equal(unpacked_codes(q), codes)
    assert torch.equal(dequantize(q), values)  # bit-exact: the same values as one code per byte gave
    assert bitwise_equal(dequantize_rows(q, dtype, num_rows=num_chunk_rows), values.to(dtype))  # any chunking


@FAST
@given(st.sampled_from(WEIGHT_DTYPES), st.sampled_from((8, 4)), matrices, matrices)
def test_an_expert_low_bit_copy_is_counted_as_held(dtype, bits, gate_up_shape, down_shape) -> None:
    parts = [quantize(torch.randn(s).to(dtype), bits, axis=1) for s in (gate_up_shape, down_shape)]
    assert lowbit_expert_nbytes((gate_up_shape, down_shape), bits) == sum(map(held_bytes, parts))


kv_shapes = st.tuples(st.integers(1, 3), st.integers(1, 9), st.integers(1, 20), st.integers(1, 40))


@FAST
@given(st.sampled_from(WEIGHT_DTYPES), st.sampled_from((8, 4)), kv_shapes, st.integers(0, 2**16))
def test_a_kv_quantized_copy_holds_the_bytes_it_is_counted_for(dtype, bits, dims, seed) -> None:
    heads, block_size, key_dim, value_dim = dims
    shape = (heads, block_size, key_dim + value_dim)
    block = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    quant = quantize_kv(block, bits, key_dim)
    assert quant.keys is not None and quant.values is not None
    assert quant.num_bytes == quant_kv_nbytes(shape, bits, key_dim) == held_bytes(quant.keys) + held_bytes(quant.values)
    _, keys = former_codes_and_values(block[..., :key_dim], bits, 1, block_size)
    _, values = former_codes_and_values(block[..., key_dim:], bits, 2, min(32, value_dim))
    assert torch.equal(dequantize_kv(quant), torch.cat([keys, values], dim=-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", [SpillMode.HOST_INT8, SpillMode.HOST_INT4, SpillMode.HOST_FULL_AND_INT4])
def test_the_kv_host_check_admits_exactly_what_the_copy_reserves(dtype, mode, tmp_path: pathlib.Path) -> None:
    """A host budget of exactly the copy's bytes fits and is filled to the byte; one byte less does not fit
    (the former `bytes_per_block // 4` passed bf16 int8 copies that then overran the host reserve)."""
    heads, block_size, key_dim, value_dim = 2, 5, 12, 9
    full = heads * block_size * (key_dim + value_dim) * dtype.itemsize
    bits = 4 if mode is not SpillMode.HOST_INT8 else 8
    needed = quant_kv_nbytes((heads, block_size, key_dim + value_dim), bits, key_dim)
    needed += full if mode is SpillMode.HOST_FULL_AND_INT4 else 0
    for host_budget in (needed - 1, needed):
        host = TierPool("host", host_budget)
        kv = KVStore(1, heads, key_dim, value_dim, block_size, TierPool("device", 1 << 20), host,
                     SpillDir(tmp_path), torch.device("cpu"), dtype)  # fmt: skip
        kv.add_sequence("r")
        kv.append("r", block_size)
        kv.write("r", 0, 0, torch.randn(heads, block_size, key_dim), torch.randn(heads, block_size, value_dim))
        assert kv.spill_cost_fits_host(mode) is (host_budget == needed)
        if host_budget == needed:
            block = kv.blocks("r", 0)[0]
            kv.spill_block(block, mode)
            assert block.host_q is not None and block.host_q.keys is not None and block.host_q.values is not None
            held = held_bytes(block.host_q.keys) + held_bytes(block.host_q.values)
            held += block.host.nbytes if block.host is not None else 0  # a slot of the host tier tensor
            assert host.used_bytes_by_kind[ObjectKind.KV_BLOCK] == held == host_budget


@FAST
@given(st.tuples(st.integers(1, 4), st.integers(1, 33)), st.integers(0, 2**16))
def test_int4_packing_round_trips(shape, seed) -> None:
    codes = torch.randint(0, 16, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    packed = pack_int4(codes)
    assert packed.shape == (*shape[:-1], -(-shape[-1] // 2))
    assert torch.equal(unpack_int4(packed, shape[-1]), codes)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_spilled_quantized_block_reads_back_the_same(bits: int, tmp_path: pathlib.Path) -> None:
    block = torch.randn(2, 5, 21).to(torch.bfloat16)
    quant = quantize_kv(block, bits, 12)
    spill = SpillDir(tmp_path)
    on_disk = write_quant(spill, "b", quant)
    assert sum(r.num_bytes for r in on_disk.records) == quant.num_bytes  # packed codes on disk too
    back = read_quant(spill, on_disk)
    assert back.num_bytes == quant.num_bytes
    assert torch.equal(dequantize_kv(back), dequantize_kv(quant))


fp8_blocks = st.tuples(st.sampled_from((1, 2, 4, 8)), st.sampled_from((1, 2, 4, 8)), st.sampled_from((4, 16)))


@FAST
@given(fp8_blocks, st.sampled_from(DTYPES), st.integers(0, 2**16))
def test_an_fp8_held_expert_is_counted_at_its_storage_bytes(grid, dtype, seed) -> None:
    """An FP8 host copy (codes + fp32 block scales, as the checkpoint stores it) is counted for exactly the
    storages it holds, and filling a slot from it is the whole-tensor dequantization bitwise."""
    block_rows, block_cols, block = grid
    inter, hidden = block_rows * block, block_cols * block
    gen = torch.Generator().manual_seed(seed)
    coded = [fp8.quantize_blocks(torch.randn(r, c, generator=gen), (block, block))
             for r, c in ((inter, hidden), (inter, hidden), (hidden, inter))]  # fmt: skip
    held = BlockScaled(torch.cat([coded[0][0], coded[1][0]]), coded[2][0], tuple(s for _, s in coded))
    assert held.num_bytes == storage_bytes(held.gate_up, held.down, *held.scales)
    assert held.num_bytes == 3 * inter * hidden + 4 * 3 * block_rows * block_cols
    slot = ExpertWeights(torch.empty(2 * inter, hidden, dtype=dtype), torch.empty(hidden, inter, dtype=dtype))
    fp8_experts.write_into(slot, held)
    whole = [fp8.dequantize(c, s, dtype) for c, s in coded]
    assert bitwise_equal(slot.gate_up, torch.cat(whole[:2])) and bitwise_equal(slot.down, whole[2])
    assert slot.num_bytes == 3 * inter * hidden * dtype.itemsize

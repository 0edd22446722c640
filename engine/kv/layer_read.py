"""One layer's K/V of one request, read from whatever tier holds each block (per-layer staging).

A request whose KV does not fit the device budget as a whole still runs: at each layer its blocks are
laid out in one [kv_heads, tokens, width] buffer, the device-resident ones copied from the layer's slot
tensor with one index (the block table), the others read into their places from the host, the disk or
the step's scratch; attention reads the buffer and the executor releases it before the layer's experts.
The buffer's bytes are counted in the device pool while it lives: the resident blocks' copies as
Scratch.KV_GATHER, the staged blocks as Scratch.KV_STAGED. The values are the same bytes a whole-request
gather would hold, so attention over them is bitwise the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from fallbackgate.engine.errors import EngineError
from fallbackgate.engine.kv.block import KVBlock
from fallbackgate.engine.kv.store import KVStore


@dataclasses.dataclass(slots=True, frozen=True)
class LayerRead:
    """What one request's layer read needs in the device pool."""

    num_resident: int  # blocks copied from device slots (or the step's scratch)
    num_staged: int  # blocks read from another tier into the buffer
    num_blocks: int  # blocks of the buffer (resident + staged)


def plan_layer_read(kv: KVStore, request_id: str, layer: int, length: int) -> LayerRead:
    """How many of the blocks holding positions 0..length of a request's layer are readable in place (on
    device or staged) and how many must be staged into the buffer."""
    blocks = kv.blocks(request_id, layer)[: -(-length // kv.block_size)]
    num_staged = sum(1 for b in blocks if b.device is None and b.key not in kv.scratch)
    return LayerRead(len(blocks) - num_staged, num_staged, len(blocks))


def read_layer(
    kv: KVStore,
    request_id: str,
    layer: int,
    length: int,
    stage_off: Callable[[KVBlock, torch.Tensor], None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """K [kv_heads, length, key_dim] and V [kv_heads, length, value_dim] of a request's layer.

    Device blocks are gathered by slot index; a block neither on device nor in the scratch is handed to
    `stage_off` with its place in the buffer, which it fills (read, dequantized: the caller's fallback).
    A single-block read is the block itself when it is readable in place.
    """
    blocks = kv.blocks(request_id, layer)[: -(-length // kv.block_size)]
    if len(blocks) == 1 and (blocks[0].device is not None or blocks[0].key in kv.scratch):
        return kv.gather(request_id, layer, length)
    heads, block_size, width = kv.block_shape
    buffer = torch.empty((heads, len(blocks), block_size, width), dtype=kv.dtype, device=kv.device)
    slots = [b.device_slot if b.device_slot is not None else 0 for b in blocks]
    if kv.device_slots is not None and any(b.device_slot is not None for b in blocks):
        kv.device_slots.gather_into(layer, slots, buffer)
    for position, block in enumerate(blocks):
        if block.device_slot is not None:
            continue
        staged = kv.scratch.get(block.key)
        if staged is None:
            stage_off(block, buffer[:, position])
        elif staged.tensor.shape != kv.block_shape:
            raise EngineError(f"KV block {block.key}: staged {tuple(staged.tensor.shape)}, not {kv.block_shape}")
        else:
            buffer[:, position].copy_(staged.tensor)
    both = buffer.view(heads, len(blocks) * block_size, width)[:, :length]
    return both[..., : kv.key_dim], both[..., kv.key_dim :]

"""A KV block, its copies, and the ways a block leaves the device or comes back for one step."""

from __future__ import annotations

import dataclasses
import enum

import torch

from fallbackgate.engine.kv.codec import QuantKV
from fallbackgate.engine.kv.spill import SpillRecord
from fallbackgate.engine.tags import Tag, Tier

KVBlockKey = tuple[str, int, int]  # (request_id, layer, block_index)


class RequestBlockKeys:
    """A set of KV block keys held as whole requests plus single keys: every block of `request_ids` (those
    that exist, or are created while it is held) and each key added. Membership is O(1) and building it
    walks no block table, so pinning a step's requests costs the number of requests, not of their blocks."""

    __slots__ = ("keys", "request_ids")

    def __init__(self, request_ids: frozenset[str] = frozenset()) -> None:
        self.request_ids = request_ids  # requests whose every block is in the set
        self.keys: set[KVBlockKey] = set()  # single keys added besides

    def __contains__(self, key: object) -> bool:
        return isinstance(key, tuple) and (key[0] in self.request_ids or key in self.keys)

    def add(self, key: KVBlockKey) -> None:
        self.keys.add(key)


class SpillMode(str, enum.Enum):
    """Where and in which precision a block's copy is written when it leaves device."""

    HOST_FULL = "host_full"
    HOST_INT8 = "host_int8"
    HOST_INT4 = "host_int4"
    DISK_FULL = "disk_full"
    DISK_INT8 = "disk_int8"
    DISK_FULL_AND_INT8 = "disk_full_and_int8"  # both copies on disk (a CPU, where RAM is the fast tier)
    HOST_FULL_AND_INT8 = "host_full_and_int8"  # both copies: the reader may choose exact_load or kv_dequant
    HOST_FULL_AND_INT4 = "host_full_and_int4"
    DROP = "drop"  # no copy kept: the block must be rebuilt by recompute


FULL_COPY_MODES = frozenset(
    {
        SpillMode.HOST_FULL,
        SpillMode.DISK_FULL,
        SpillMode.HOST_FULL_AND_INT8,
        SpillMode.HOST_FULL_AND_INT4,
        SpillMode.DISK_FULL_AND_INT8,
    }
)  # the modes that keep a full-precision copy (what a partial tail needs: its request writes to it again)
DISK_MODES = frozenset({SpillMode.DISK_FULL, SpillMode.DISK_INT8, SpillMode.DISK_FULL_AND_INT8})  # copies on disk
DISK_FALLBACK = {
    SpillMode.HOST_INT8: SpillMode.DISK_INT8,
    SpillMode.HOST_INT4: SpillMode.DISK_INT8,
    SpillMode.HOST_FULL_AND_INT8: SpillMode.DISK_FULL_AND_INT8,
    SpillMode.HOST_FULL_AND_INT4: SpillMode.DISK_FULL_AND_INT8,
}  # the disk copies a host mode becomes when the host holds no room (the rest: DISK_FULL)
BOTH_COPIES = {
    SpillMode.HOST_FULL_AND_INT8: (SpillMode.HOST_FULL, SpillMode.HOST_INT8),
    SpillMode.HOST_FULL_AND_INT4: (SpillMode.HOST_FULL, SpillMode.HOST_INT4),
    SpillMode.DISK_FULL_AND_INT8: (SpillMode.DISK_FULL, SpillMode.DISK_INT8),
}  # the modes that write two copies: the full one and the quantized one, in that order


@dataclasses.dataclass(slots=True)
class KVBlock:
    """One layer's K and V for `block_size` tokens of one request, and where its copies are."""

    key: KVBlockKey
    num_tokens: int = 0  # filled positions
    device: torch.Tensor | None = None  # [kv_heads, block_size, key_dim + value_dim]: a view of its device slot
    host: torch.Tensor | None = None  # full-precision host copy: a view of its host slot
    device_slot: int | None = None  # its slot in the layer's device tensor (the block-table entry)
    host_slot: int | None = None  # its slot in the layer's host tensor
    host_q: QuantKV | None = None  # quantized host copy
    disk: SpillRecord | None = None  # full-precision disk copy
    disk_q: QuantKV | None = None  # quantized disk copy (records inside)

    @property
    def has_exact_copy(self) -> bool:
        return self.device is not None or self.host is not None or self.disk is not None

    @property
    def has_quant_copy(self) -> bool:
        return self.host_q is not None or self.disk_q is not None


@dataclasses.dataclass(slots=True)
class Staged:
    """A block made usable for one step without a device slot."""

    tensor: torch.Tensor  # values attention will read
    tag: Tag  # exact_load, kv_dequant or recompute
    source_tier: Tier | None  # where bytes came from
    bytes_moved: int  # bytes read over a link
    note: str = ""
    key: KVBlockKey | None = None  # the block this was staged for

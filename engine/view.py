"""The engine's :class:`~fallbackgate.engine.controller.ControllerView`: read-only queries over its live state.

Every query reads the stores when it is called and answers with plain values or immutable snapshots; the
view keeps its sources in private slots and hands none of them out.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from fallbackgate.engine.controller import KVBlockInfo
from fallbackgate.engine.device_pool import HeldCopy
from fallbackgate.engine.experts.quant import lowbit_expert_nbytes
from fallbackgate.engine.experts.sources import ExpertKey
from fallbackgate.engine.experts.store import ExpertStore
from fallbackgate.engine.hardware import HardwareProfile
from fallbackgate.engine.io import EMPTY_SNAPSHOT, IOScheduler, IOSnapshot
from fallbackgate.engine.kv.block import KVBlock, KVBlockKey
from fallbackgate.engine.kv.codec import quant_kv_nbytes, relative_error_energy
from fallbackgate.engine.kv.prefix_cache import PrefixCache, PrefixEntryInfo
from fallbackgate.engine.kv.store import KVStore
from fallbackgate.engine.scheduler import Scheduler
from fallbackgate.engine.sequence import Sequence
from fallbackgate.engine.step_context import StepUses
from fallbackgate.engine.tags import ObjectKind, Tag, Tier


def _nearest_tier(*copies: tuple[Tier, object | None]) -> Tier | None:
    """The first tier, nearest first, whose copy exists (None: no copy)."""
    return next((tier for tier, copy in copies if copy is not None), None)


def block_info(block: KVBlock) -> KVBlockInfo:
    """The snapshot of one block's copies: its nearest full-precision copy and its nearest quantized copy."""
    exact = _nearest_tier((Tier.DEVICE, block.device), (Tier.HOST, block.host), (Tier.DISK, block.disk))
    quant_tier = _nearest_tier((Tier.HOST, block.host_q), (Tier.DISK, block.disk_q))
    quant = block.host_q if block.host_q is not None else block.disk_q
    if quant is None:
        return KVBlockInfo(block.key, block.num_tokens, exact, None)
    return KVBlockInfo(block.key, block.num_tokens, exact, quant_tier, quant.bits, quant.num_bytes)


class LiveView:
    """Controllers' read-only view of a running engine (see the module docstring); each query is documented
    on :class:`~fallbackgate.engine.controller.ControllerView`."""

    __slots__ = ("_experts", "_io", "_kv", "_num_experts", "_num_expert_layers", "_prefix", "_profile", "_scheduler",
                 "_sequences", "_uses")  # fmt: skip

    def __init__(
        self,
        expert_store: ExpertStore,
        kv_store: KVStore,
        profile: HardwareProfile,
        sequences: Mapping[str, Sequence],
        scheduler: Scheduler,
        uses: StepUses,
        io: IOScheduler | None = None,
        prefix: PrefixCache | None = None,
    ) -> None:
        self._experts, self._kv, self._profile = expert_store, kv_store, profile
        self._sequences, self._scheduler, self._uses = sequences, scheduler, uses
        self._io, self._prefix = io, prefix
        self._num_experts = len({e for _, e in expert_store.entries})  # the store's entries are fixed at its build
        self._num_expert_layers = len({layer for layer, _ in expert_store.entries})

    def io_snapshot(self) -> IOSnapshot:
        return self._io.snapshot() if self._io is not None else EMPTY_SNAPSHOT

    @property
    def is_ram_tiered(self) -> bool:
        return self._experts.is_ram_tiered

    @property
    def profile(self) -> HardwareProfile:
        return self._profile

    @property
    def measured_compute_s(self) -> float:
        return self._uses.measured_compute_s

    def request_class(self, request_id: str) -> str:
        seq = self._sequences.get(request_id)
        return seq.request_class if seq is not None and not seq.is_finished else ""

    @property
    def running_ids(self) -> tuple[str, ...]:
        return tuple(s.request_id for s in self._scheduler.running)

    @property
    def used_expert_keys(self) -> tuple[ExpertKey, ...]:
        return tuple(self._uses.used_expert_keys)

    @property
    def used_kv_block_keys(self) -> tuple[KVBlockKey, ...]:
        return tuple(self._uses.used_kv_block_keys)

    @property
    def deferred_expert_keys(self) -> tuple[ExpertKey, ...]:
        return tuple(self._uses.deferred_expert_keys)

    @property
    def device_budget_bytes(self) -> int:
        return self._experts.device_pool.budget_bytes

    @property
    def device_free_bytes(self) -> int:
        return self._experts.device_pool.free_bytes

    def device_used_bytes(self, kind: ObjectKind | HeldCopy) -> int:
        return self._experts.device_pool.used_bytes_by_kind[kind]

    @property
    def bytes_per_expert(self) -> int:
        return self._experts.bytes_per_expert

    @property
    def num_experts(self) -> int:
        return self._num_experts

    @property
    def compute_dtype(self) -> str:
        return str(self._experts.reader.compute_dtype).removeprefix("torch.")

    @property
    def num_expert_params(self) -> int:
        return self._experts.bytes_per_expert // self._experts.reader.compute_dtype.itemsize

    def device_expert_keys(self) -> tuple[ExpertKey, ...]:
        return tuple(self._experts.device_keys())

    def is_expert_on_device(self, key: ExpertKey) -> bool:
        return self._experts.is_on_device(key)

    def expert_home(self, key: ExpertKey) -> Tier:
        return self._experts.home(key)

    def kv_changes_since(self, cursor: int) -> tuple[tuple[tuple[KVBlockKey, bool], ...] | None, int]:
        return None, -1  # no device KV journal here: a controller walks device_kv_blocks_of

    def expert_changes_since(self, cursor: int) -> tuple[tuple[ExpertKey, ...] | None, int]:
        changed, cursor = self._experts.journal.since(cursor)
        return (tuple(changed) if changed is not None else None), cursor

    @property
    def num_layers(self) -> int:
        return self._kv.num_layers

    @property
    def num_expert_layers(self) -> int:
        return self._num_expert_layers

    @property
    def block_size(self) -> int:
        return self._kv.block_size

    @property
    def bytes_per_kv_block(self) -> int:
        return self._kv.bytes_per_block

    def quantized_bytes(self, kind: ObjectKind, bits: int) -> int:
        if kind is ObjectKind.EXPERT:
            return lowbit_expert_nbytes(self._experts.reader.matrix_shapes, bits)
        if kind is ObjectKind.KV_BLOCK:
            return quant_kv_nbytes(self._kv.block_shape, bits, self._kv.key_dim)
        raise ValueError(f"no quantized copy of a {kind.value}")

    def num_kv_tokens(self, request_id: str) -> int:
        return self._kv.num_tokens.get(request_id, 0)

    def off_device_kv_blocks(self, request_id: str, num_blocks: int) -> tuple[KVBlockInfo, ...]:
        return tuple(block_info(b) for b in self._kv.off_device_blocks(request_id, num_blocks))

    def device_kv_blocks(self) -> tuple[KVBlockInfo, ...]:
        return tuple(block_info(b) for b in self._kv.device_blocks())

    @property
    def kv_request_ids(self) -> tuple[str, ...]:
        return tuple(self._kv.tables)

    def device_kv_blocks_of(self, request_id: str, is_index_major: bool = False) -> Iterator[KVBlockInfo]:
        return (block_info(b) for b in self._kv.device_blocks_of(request_id, is_index_major))

    def staged_kv_tag(self, key: KVBlockKey) -> Tag | None:
        staged = self._kv.scratch.get(key)
        return staged.tag if staged is not None else None

    def kv_quant_error_energy(self, key: KVBlockKey) -> float | None:
        request_id, layer, index = key
        table = self._kv.tables.get(request_id)
        blocks = table[layer] if table is not None else []
        quant = (blocks[index].host_q or blocks[index].disk_q) if index < len(blocks) else None
        return relative_error_energy(quant) if quant is not None else None

    def prefix_entry(self, request_id: str) -> PrefixEntryInfo | None:
        return self._prefix.entry_info(request_id) if self._prefix is not None else None

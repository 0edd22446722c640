"""A :class:`~fallbackgate.engine.controller.ControllerView` built from plain data, with no engine behind it:
what a controller sees when it is driven from synthetic misses or from a recorded step walk (the tests,
``fallbackgate.bench.victims_oracle``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from types import MappingProxyType

from fallbackgate.engine.controller import KVBlockInfo
from fallbackgate.engine.device_pool import HeldCopy
from fallbackgate.engine.hardware import HardwareProfile
from fallbackgate.engine.io import EMPTY_SNAPSHOT, IOSnapshot
from fallbackgate.engine.kv.prefix_cache import PrefixEntryInfo
from fallbackgate.engine.tags import ObjectKind, Tag, Tier

ExpertKey = tuple[int, int]
KVBlockKey = tuple[str, int, int]


def _frozen(mapping: Mapping | None = None) -> MappingProxyType:
    return MappingProxyType(dict(mapping or {}))


@dataclasses.dataclass(frozen=True)
class StaticView:
    """Fixed engine state: every query answers from the fields (experts not listed as on device are homed on
    the host unless `expert_homes` says otherwise)."""

    profile: HardwareProfile
    request_classes: Mapping[str, str] = dataclasses.field(default_factory=_frozen)
    running_ids: tuple[str, ...] = ()
    used_expert_keys: tuple[ExpertKey, ...] = ()
    used_kv_block_keys: tuple[KVBlockKey, ...] = ()
    deferred_expert_keys: tuple[ExpertKey, ...] = ()
    device_budget_bytes: int = 0
    device_free_bytes: int = 0
    device_bytes_by_kind: Mapping[ObjectKind, int] = dataclasses.field(default_factory=_frozen)
    bytes_per_expert: int = 0
    num_experts: int = 8
    compute_dtype: str = "float32"
    num_expert_params: int = 0
    on_device_experts: tuple[ExpertKey, ...] = ()
    expert_homes: Mapping[ExpertKey, Tier] = dataclasses.field(default_factory=_frozen)
    num_layers: int = 1
    num_expert_layers: int | None = None  # None: every layer routes to experts
    block_size: int = 16
    bytes_per_kv_block: int = 0
    kv_blocks: tuple[KVBlockInfo, ...] = ()
    kv_tokens: Mapping[str, int] = dataclasses.field(default_factory=_frozen)
    staged_kv_tags: Mapping[KVBlockKey, Tag] = dataclasses.field(default_factory=_frozen)
    quant_error_energies: Mapping[KVBlockKey, float] = dataclasses.field(default_factory=_frozen)
    quantized_copy_bytes: Mapping[tuple[ObjectKind, int], int] = dataclasses.field(default_factory=_frozen)
    io: IOSnapshot = EMPTY_SNAPSHOT
    measured_compute_s: float = 0.0  # the engine's measured decode compute time (0.0: none measured)
    is_ram_tiered: bool = False  # the RAM/disk layout (a CPU): disk reads land in RAM, no host tier
    prefix_entries: Mapping[str, PrefixEntryInfo] = dataclasses.field(default_factory=_frozen)  # kept prefixes

    def __post_init__(self) -> None:
        if self.num_expert_layers is None:
            object.__setattr__(self, "num_expert_layers", self.num_layers)
        if not 0 <= self.num_expert_layers <= self.num_layers:  # dataclasses.replace keeps an earlier default
            raise ValueError(f"num_expert_layers {self.num_expert_layers} is not within num_layers {self.num_layers}")
        names = ("request_classes", "device_bytes_by_kind", "expert_homes", "kv_tokens", "staged_kv_tags")
        for name in (*names, "quant_error_energies", "quantized_copy_bytes", "prefix_entries"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))

    def request_class(self, request_id: str) -> str:
        return self.request_classes.get(request_id, "")

    def device_used_bytes(self, kind: ObjectKind | HeldCopy) -> int:
        return self.device_bytes_by_kind.get(kind, 0)

    def device_expert_keys(self) -> tuple[ExpertKey, ...]:
        return self.on_device_experts

    def is_expert_on_device(self, key: ExpertKey) -> bool:
        return key in self.on_device_experts

    def expert_home(self, key: ExpertKey) -> Tier:
        return self.expert_homes.get(key, Tier.HOST)

    def kv_changes_since(self, cursor: int) -> tuple[None, int]:
        return None, -1  # fixed state, no journal: a controller walks device_kv_blocks_of

    def expert_changes_since(self, cursor: int) -> tuple[tuple[ExpertKey, ...] | None, int]:
        return None, -1  # fixed state, no journal: a controller walks device_expert_keys

    def quantized_bytes(self, kind: ObjectKind, bits: int) -> int:
        if (kind, bits) not in self.quantized_copy_bytes:
            raise KeyError(f"StaticView: no quantized_copy_bytes for ({kind.value}, {bits} bits)")
        return self.quantized_copy_bytes[(kind, bits)]

    def num_kv_tokens(self, request_id: str) -> int:
        return self.kv_tokens.get(request_id, 0)

    def off_device_kv_blocks(self, request_id: str, num_blocks: int) -> tuple[KVBlockInfo, ...]:
        mine = [b for b in self.kv_blocks if b.key[0] == request_id and b.key[2] < num_blocks]
        return tuple(b for b in sorted(mine, key=lambda b: b.key[1:]) if not b.is_on_device)

    def device_kv_blocks(self) -> tuple[KVBlockInfo, ...]:
        return tuple(b for b in self.kv_blocks if b.is_on_device)

    @property
    def kv_request_ids(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(b.key[0] for b in self.kv_blocks))

    def device_kv_blocks_of(self, request_id: str, is_index_major: bool = False) -> Iterator[KVBlockInfo]:
        mine = [b for b in self.kv_blocks if b.is_on_device and b.key[0] == request_id]
        return iter(sorted(mine, key=lambda b: (b.key[2], b.key[1])) if is_index_major else mine)

    def prefix_entry(self, request_id: str) -> PrefixEntryInfo | None:
        return self.prefix_entries.get(request_id)

    def staged_kv_tag(self, key: KVBlockKey) -> Tag | None:
        return self.staged_kv_tags.get(key)

    def kv_quant_error_energy(self, key: KVBlockKey) -> float | None:
        return self.quant_error_energies.get(key)

    def io_snapshot(self) -> IOSnapshot:
        return self.io

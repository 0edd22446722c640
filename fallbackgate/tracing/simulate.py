"""``fallbackgate trace simulate``: the project's own controllers, through the read-only ControllerView, over a
trace's access sequence without the model — hits, misses, bytes by tag, stalls and SLO attainment under a
device model.

:class:`SimulatedView` keeps what the engine would: experts and KV blocks on device within one device budget,
the nearest copy of every KV block taken off device, the keys used in the step. Per step the controller sees
``on_step_start``; every off-device KV block read is a :class:`KVMiss` and every off-device expert a
:class:`ExpertMiss`; room is made with its ``choose_victims``; ``on_step_end``'s spills, evictions and
expert loads are applied. A KV block's first access is its write (it takes device room, never a miss),
unless it adopts a kept prefix block: a request's full blocks stay in the budget when it ends, as the engine's
prefix reuse keeps them (:mod:`fallbackgate.tracing.sim_prefix`). As in the engine, a layer's attention holds
its requests' K/V gathered in one buffer (every block of a request longer than one block) inside the budget
until the layer's experts run: its room is made with nothing but the step's KV pinned, so experts may leave
for it. Simplified against the engine (stated in the results): experts' homes are the host; a lowbit or
dequant read moves bits/16 of the full bytes; recompute and cpu_execute are counted, not timed; step-end
expert loads are prefetches (link bytes, no stall); the engine's other scratch (staged KV, low-bit copies,
write-behind buffers) is not modelled. A compression what-if (``SimulationConfig.expert_bytes_scale``,
``kv_bytes_scale``) shrinks every expert or KV block to that fraction of its recorded bytes, in room and on the
link; compute, routing and the requests' accesses stay the recorded ones, and a low-bit copy stays half the
stored bytes. A KV scale above 1 grows every KV block likewise: a model with more KV bytes per token against
its experts, serving the same accesses.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from collections.abc import Iterator

from fallbackgate.engine.controller import KVBlockInfo
from fallbackgate.engine.hardware import HardwareProfile
from fallbackgate.engine.io import EMPTY_SNAPSHOT, IOSnapshot
from fallbackgate.engine.kv.prefix_types import PREFIX_ID, PrefixEntryInfo
from fallbackgate.engine.kv.store import SpillMode
from fallbackgate.engine.tags import ObjectKind, Tag, Tier
from fallbackgate.tracing.devices import DeviceModel
from fallbackgate.tracing.sim_prefix import KeptPrefixes

ExpertKey = tuple[int, int]
KVKey = tuple[str, int, int]
QUANT_BITS = 8  # bits of the quantized copies the simulator offers


def profile_of(device: DeviceModel) -> HardwareProfile:
    """A hardware profile whose links are the device model's (compute rates are the CPU box's)."""
    bw, lat = device.bandwidth_bytes_per_s, device.latency_ns / 1e9
    return HardwareProfile(f"trace:{device.name}", bw, bw, bw, bw, 40e9, 40e9, link_latency_s=max(lat, 1e-9))


def _copies(mode: SpillMode) -> tuple[Tier | None, Tier | None, int]:
    """(exact tier, quantized tier, bits) of the copy a spill leaves."""
    text = mode.value
    if text == "drop":
        return None, None, 0
    tier = Tier.DISK if text.startswith("disk") else Tier.HOST
    bits = 8 if "int8" in text else 4 if "int4" in text else 0
    return (tier if "full" in text else None), (tier if bits else None), bits


def _index_major(info: KVBlockInfo) -> tuple[int, int]:
    return info.key[2], info.key[1]


class SimulatedView:
    """The engine state a controller may read, kept by the simulator (read-only to the controller)."""

    def __init__(self, device: DeviceModel, budget_bytes: int, num_layers: int, num_experts: int,
                 bytes_per_expert: int, bytes_per_kv_block: int, block_size: int, classes: dict[str, str]):  # fmt: skip
        self.profile = profile_of(device)
        self.is_ram_tiered = False  # the device model's tiers: device, host, disk
        self.measured_compute_s = 0.0  # nothing is measured in a simulation: deadlines use the device model
        self.device_budget_bytes = int(budget_bytes)
        self.num_layers, self.num_experts, self.block_size = num_layers, num_experts, block_size
        self.num_expert_layers = num_layers  # a trace with dense layers says so (Simulator)
        self.bytes_per_expert, self.bytes_per_kv_block = bytes_per_expert, bytes_per_kv_block
        self.compute_dtype, self.num_expert_params = "bfloat16", bytes_per_expert // 2
        self.classes = classes
        self.experts: dict[ExpertKey, None] = {}  # on device
        self.prefix: KeptPrefixes | None = None  # kept prefix blocks (None: no content hashes, or reuse was off)
        self.step_index = 0  # the step being simulated (kept entries' idle steps)
        self.staged: dict[KVKey, Tag] = {}  # KV blocks read from off device this step -> the tag they were read with
        self.kv: dict[KVKey, tuple[Tier | None, Tier | None, int]] = {}  # (exact, quant tier, bits); device: exact
        self.device_infos: dict[KVKey, KVBlockInfo] = {}  # the device blocks' infos
        self.by_request: dict[str, dict[KVKey, KVBlockInfo]] = {}  # the same, per request, in device order
        self._seq: dict[KVKey, int] = {}  # when each device block came on device (device_infos order)
        self._next_seq = 0
        self._request_ids: tuple[str, ...] | None = ()  # kv_request_ids, until membership changes
        self._index_major: dict[str, list[KVBlockInfo]] = {}  # per request, by (block, layer), kept sorted
        self._device_tuple: tuple[KVBlockInfo, ...] | None = ()  # device_kv_blocks(), until the next change
        self._kv_journal: list[tuple[KVKey, bool]] = []  # (block, whether it came on device), in order
        self.running_ids: tuple[str, ...] = ()
        self.used_expert_keys: tuple[ExpertKey, ...] = ()
        self.used_kv_block_keys: tuple[KVKey, ...] = ()
        self.deferred_expert_keys: tuple[ExpertKey, ...] = ()
        self.max_block: dict[str, int] = collections.defaultdict(int)

    @property
    def num_kv_on_device(self) -> int:
        return len(self.device_infos)

    def set_kv(self, key: KVKey, copies: tuple[Tier | None, Tier | None, int]) -> None:
        """Where a block's copies now are (exact tier, quantized tier, bits); device blocks keep one info."""
        self.kv[key] = copies
        if copies[0] is Tier.DEVICE:
            info = self._info(key)
            ordered = self._index_major.setdefault(key[0], [])
            if key not in self.device_infos:
                self._seq[key] = self._next_seq
                self._next_seq += 1
                self._request_ids = None
                self._kv_journal.append((key, True))
                bisect.insort(ordered, info, key=_index_major)
            else:
                ordered[bisect.bisect_left(ordered, _index_major(info), key=_index_major)] = info
            self.device_infos[key] = info
            self.by_request.setdefault(key[0], {})[key] = info
            self._device_tuple = None
        else:
            self._off_device(key)

    def drop_kv(self, key: KVKey) -> None:
        """Forget a block (its request ended)."""
        del self.kv[key]
        self._off_device(key)

    def _off_device(self, key: KVKey) -> None:
        if self.device_infos.pop(key, None) is None:
            return
        self._device_tuple, self._request_ids = None, None
        self._kv_journal.append((key, False))
        del self._seq[key]
        mine = self.by_request[key[0]]
        del mine[key]
        ordered = self._index_major[key[0]]
        del ordered[bisect.bisect_left(ordered, (key[2], key[1]), key=_index_major)]
        if not mine:
            del self.by_request[key[0]]
            del self._index_major[key[0]]

    @property
    def device_free_bytes(self) -> int:
        used = len(self.experts) * self.bytes_per_expert + self.num_kv_on_device * self.bytes_per_kv_block
        return self.device_budget_bytes - used

    def request_class(self, request_id: str) -> str:
        return self.classes.get(request_id, "")

    def device_used_bytes(self, kind: ObjectKind) -> int:
        if kind is ObjectKind.EXPERT:
            return len(self.experts) * self.bytes_per_expert
        return self.num_kv_on_device * self.bytes_per_kv_block

    def device_expert_keys(self) -> tuple[ExpertKey, ...]:
        return tuple(self.experts)

    def is_expert_on_device(self, key: ExpertKey) -> bool:
        return key in self.experts

    def expert_home(self, key: ExpertKey) -> Tier:
        return Tier.HOST

    def expert_changes_since(self, cursor: int) -> tuple[tuple[ExpertKey, ...] | None, int]:
        return None, -1  # no residency journal: a controller walks device_expert_keys

    def kv_changes_since(self, cursor: int) -> tuple[tuple[tuple[KVKey, bool], ...] | None, int]:
        """(block, whether it came on device) for every device KV change since ``cursor``, in order."""
        end = len(self._kv_journal)
        return (None if cursor < 0 else tuple(self._kv_journal[cursor:])), end

    def quantized_bytes(self, kind: ObjectKind, bits: int) -> int:
        full = self.bytes_per_expert if kind is ObjectKind.EXPERT else self.bytes_per_kv_block
        return full * bits // 16

    def num_kv_tokens(self, request_id: str) -> int:
        return (self.max_block[request_id] + 1) * self.block_size

    def _info(self, key: KVKey) -> KVBlockInfo:
        exact, quant, bits = self.kv[key]
        return KVBlockInfo(key, self.block_size, exact, quant, bits, self.bytes_per_kv_block * bits // 16)

    def off_device_kv_blocks(self, request_id: str, num_blocks: int) -> tuple[KVBlockInfo, ...]:
        keys = [(request_id, layer, b) for layer in range(self.num_layers) for b in range(num_blocks)]
        return tuple(self._info(k) for k in keys if k in self.kv and self.kv[k][0] is not Tier.DEVICE)

    @property
    def kv_request_ids(self) -> tuple[str, ...]:
        """Requests with device blocks, in the device order of their oldest one."""
        if self._request_ids is None:
            first = {rid: self._seq[next(iter(mine))] for rid, mine in self.by_request.items()}
            self._request_ids = tuple(sorted(first, key=first.__getitem__))
        return self._request_ids

    def device_kv_blocks_of(self, request_id: str, is_index_major: bool = False) -> Iterator[KVBlockInfo]:
        if is_index_major:  # a copy: the caller may take blocks off device while it walks
            return iter(list(self._index_major.get(request_id, ())))
        return iter(list(self.by_request.get(request_id, {}).values()))

    def io_snapshot(self) -> IOSnapshot:
        return EMPTY_SNAPSHOT  # the device model prices every read; no queue is simulated

    def device_kv_blocks(self) -> tuple[KVBlockInfo, ...]:
        if self._device_tuple is None:
            self._device_tuple = tuple(self.device_infos.values())
        return self._device_tuple

    def prefix_entry(self, request_id: str) -> PrefixEntryInfo | None:
        """The kept prefix block behind pseudo request `request_id`, None for any other id."""
        if self.prefix is None or not request_id.startswith(PREFIX_ID):
            return None
        return self.prefix.info(self, request_id, self.step_index)

    def staged_kv_tag(self, key: KVKey) -> Tag | None:
        return self.staged.get(key)

    def kv_quant_error_energy(self, key: KVKey) -> float | None:
        return None


MAX_KV_BYTES_SCALE = 64.0  # the largest what-if KV growth (kv_bytes_scale above 1)


@dataclasses.dataclass(slots=True)
class SimulationConfig:
    """One configuration to simulate."""

    controller: str  # a registered ControllerKind value
    budget_bytes: int  # device budget shared by experts and KV
    device: DeviceModel  # what misses cost
    expert_fraction: float | None = None  # static split's expert share (None: the policy's)
    # what-if model-side compression: each object moves and occupies this fraction of its recorded bytes
    # (0.5: int8 of a bf16 model's experts or KV); the trace's compute and accesses stay as recorded. A KV
    # scale above 1 (at most MAX_KV_BYTES_SCALE) is a model with that many times the KV bytes per token
    # (more KV heads, a wider head): its blocks grow likewise
    expert_bytes_scale: float = 1.0
    kv_bytes_scale: float = 1.0

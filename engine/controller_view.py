"""What a controller may read about the engine's state: :class:`ControllerView`, plain values and immutable
snapshots (or, where a caller may stop early, a lazy walk that yields them), never a store, so a view can as
well be served from a recorded trace (`fallbackgate.tracing`) as from a live engine (`engine/view.py`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple, Protocol

from fallbackgate.engine.device_pool import HeldCopy
from fallbackgate.engine.experts.sources import ExpertKey
from fallbackgate.engine.hardware import HardwareProfile
from fallbackgate.engine.io.requests import IOSnapshot
from fallbackgate.engine.kv.block import KVBlockKey
from fallbackgate.engine.kv.prefix_cache import PrefixEntryInfo
from fallbackgate.engine.tags import ObjectKind, Tag, Tier


class KVBlockInfo(NamedTuple):
    """An immutable snapshot of one KV block: where its copies are, not their bytes."""

    key: KVBlockKey  # (request id, layer, block index)
    num_tokens: int  # filled positions
    exact_tier: Tier | None  # nearest full-precision copy (device, host, disk), None when none exists
    quant_tier: Tier | None  # nearest quantized copy (host, disk), None when none exists
    quant_bits: int = 0  # bits of that quantized copy (0 when none)
    quant_bytes: int = 0  # bytes of that quantized copy (0 when none)

    @property
    def is_on_device(self) -> bool:
        return self.exact_tier is Tier.DEVICE


class ControllerView(Protocol):
    """Everything a controller may read about the engine's state: plain values and immutable snapshots.

    "This step" is the step being prepared or run; "the last step" is the one whose end is being decided.
    """

    @property
    def profile(self) -> HardwareProfile:
        """Measured link and compute rates (frozen)."""
        ...

    @property
    def measured_compute_s(self) -> float:
        """Decaying mean of the recent decode steps' measured wall time less the disk reads they waited for
        (0.0 before the first decode step, and where nothing is measured: a simulation, a plan)."""
        ...

    def request_class(self, request_id: str) -> str:
        """The policy class of a live request ("" when the request is unknown or finished)."""
        ...

    @property
    def running_ids(self) -> tuple[str, ...]:
        """Requests holding device KV now."""
        ...

    @property
    def used_expert_keys(self) -> tuple[ExpertKey, ...]:
        """Experts computed in the last step, in use order."""
        ...

    @property
    def used_kv_block_keys(self) -> tuple[KVBlockKey, ...]:
        """Off-device KV blocks read in the last step."""
        ...

    @property
    def deferred_expert_keys(self) -> tuple[ExpertKey, ...]:
        """Experts deferred in the last step (their loads queued)."""
        ...

    # --- the device budget, shared by both kinds of object
    @property
    def device_budget_bytes(self) -> int:
        """The device budget."""
        ...

    @property
    def device_free_bytes(self) -> int:
        """Device budget bytes not held by anything."""
        ...

    def device_used_bytes(self, kind: ObjectKind | HeldCopy) -> int:
        """Device bytes held by objects of `kind` (``HeldCopy.EXPERT_LOWBIT``: low-bit copies kept in a CPU's RAM
        budget, the first to go when room is made)."""
        ...

    # --- experts
    @property
    def bytes_per_expert(self) -> int:
        """Full-precision bytes of one routed expert."""
        ...

    @property
    def num_experts(self) -> int:
        """Routed experts per layer."""
        ...

    @property
    def compute_dtype(self) -> str:
        """The experts' compute dtype as configs spell it ("bfloat16")."""
        ...

    @property
    def num_expert_params(self) -> int:
        """Parameters of one routed expert."""
        ...

    def device_expert_keys(self) -> tuple[ExpertKey, ...]:
        """Experts on device now."""
        ...

    def is_expert_on_device(self, key: ExpertKey) -> bool:
        """Whether `key` is on device now."""
        ...

    def expert_home(self, key: ExpertKey) -> Tier:
        """Where `key`'s full-precision copy comes from when it is loaded (host or disk)."""
        ...

    def expert_changes_since(self, cursor: int) -> tuple[Sequence[ExpertKey] | None, int]:
        """Experts whose device or host copy came or went since `cursor` (a position in the store's residency
        journal; may repeat keys), and the cursor to pass next time. None instead of the keys when the
        journal no longer reaches back that far or `cursor` is negative (walk `device_expert_keys` once
        instead); a returned cursor < 0: this view keeps no journal."""
        ...

    # --- KV
    @property
    def num_layers(self) -> int:
        """Decoder layers (each holds its own KV blocks)."""
        ...

    @property
    def num_expert_layers(self) -> int:
        """Decoder layers that route to experts (a dense layer has none): a token uses ``top_k`` experts in each."""
        ...

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        ...

    @property
    def bytes_per_kv_block(self) -> int:
        """Full-precision bytes of one KV block."""
        ...

    def quantized_bytes(self, kind: ObjectKind, bits: int) -> int:
        """Storage bytes of one `bits`-bit copy of an object of `kind` (an expert's low-bit copy, a KV block's
        quantized copy) as the engine holds it: codes (int4 packed two per byte), fp32 scales and zero points."""
        ...

    def num_kv_tokens(self, request_id: str) -> int:
        """Positions of the request written into KV blocks (0 when it has none)."""
        ...

    def off_device_kv_blocks(self, request_id: str, num_blocks: int) -> tuple[KVBlockInfo, ...]:
        """Snapshots of those of the request's first `num_blocks` blocks of every layer that are not on
        device, by layer then index, from a maintained index: the cost follows the request's off-device
        blocks, not its length."""
        ...

    def device_kv_blocks(self) -> tuple[KVBlockInfo, ...]:
        """Snapshots of every KV block on device now."""
        ...

    @property
    def kv_request_ids(self) -> tuple[str, ...]:
        """Requests holding KV blocks, in the order `device_kv_blocks` lists their blocks."""
        ...

    def kv_changes_since(self, cursor: int) -> tuple[Sequence[tuple[KVBlockKey, bool]] | None, int]:
        """(block, whether it came on device) for every device KV change since `cursor`, in order, and the
        cursor to pass next time; None instead of the changes for a negative cursor. A returned cursor < 0:
        this view keeps no journal (walk `device_kv_blocks_of`; the engine's view, for now)."""
        ...

    def device_kv_blocks_of(self, request_id: str, is_index_major: bool = False) -> Iterator[KVBlockInfo]:
        """The request's part of `device_kv_blocks`, in that order (by layer, then index; `is_index_major`:
        by index, then layer), walked lazily: snapshots are taken as the caller reaches them, so one that
        stops after k blocks pays for about k."""
        ...

    def staged_kv_tag(self, key: KVBlockKey) -> Tag | None:
        """How a block read this step without a device slot was made usable, None when it was not staged."""
        ...

    def kv_quant_error_energy(self, key: KVBlockKey) -> float | None:
        """Relative error energy ‖x − Q(x)‖² / ‖x‖² of the block's quantized copy, estimated from its group
        scales; None when it has no quantized copy in memory."""
        ...

    def prefix_entry(self, request_id: str) -> PrefixEntryInfo | None:
        """The kept prefix block whose pseudo request (one block per layer, in `kv_request_ids`) is
        `request_id`: its hits and idle steps; None for a live request's id (or where nothing is kept)."""
        ...

    @property
    def is_ram_tiered(self) -> bool:
        """Whether the engine runs on the RAM/disk layout (a CPU, ``TierLayout.RAM_DISK``): RAM is the one
        fast tier (the device pool), a disk read lands in it directly, and there is no host tier."""
        ...

    def io_snapshot(self) -> IOSnapshot:
        """The disk's I/O queue now: transfers in flight and queued, their bytes, and the requests waiting on
        them (every expert and KV read or write goes through the one scheduler)."""
        ...

"""CUDA: expert host copies in page-locked memory, so a copy to the device is one asynchronous DMA on the copy
stream instead of a staged copy that holds the host thread.

torch's pinned allocator rounds every allocation up to a power of two (a 9 MiB expert would lock 12 MiB the
host budget does not count). Instead each copy gets its own anonymous mapping of exactly its bytes rounded up
to a page, locked in place with ``cudaHostRegister`` (portable, as torch's own checkpoint stager pins memory):
the host pool counts `footprint` per copy, which bounds what is locked. A copy is unlocked only after the last
device copy out of it has completed (an event recorded on the stream that copied it), so memory a DMA still
reads is never unmapped or reused; whatever is still locked when the owner closes or is collected is unlocked
then. A failed register leaves the copy pageable (the caller counts it); a failed unregister is logged and
the bookkeeping goes on.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import mmap
import weakref
from collections.abc import Callable

import torch

from fallbackgate.engine.errors import EngineError
from fallbackgate.engine.experts.weights import BlockScaled, ExpertWeights, HeldWeights

PART_ALIGN = 256  # byte alignment of each tensor inside a copy's mapping (any dtype views it)
MAX_PARTS = 5  # gate_up, down and, for FP8, three block-scale tensors
REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, not only the current one

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class _Locked:
    mapping: mmap.mmap  # the anonymous mapping the copy's tensors view
    num_bytes: int  # bytes locked (the mapping's length)
    last_copy: torch.cuda.Event | None = None  # recorded after the latest device copy out of it


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed register, so the next kernel-launch check does not
    report it against an unrelated operation (best effort: the runtime library torch loaded)."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart" in line}
    for path in paths:
        ctypes.CDLL(path).cudaGetLastError()


def _cudart_register(ptr: int, num_bytes: int) -> None:
    code = int(torch.cuda.cudart().cudaHostRegister(ptr, num_bytes, REGISTER_PORTABLE))
    if code != 0:
        _clear_cuda_error()
        raise EngineError(f"cudaHostRegister of {num_bytes} host bytes failed with CUDA error {code}")


def _cudart_unregister(ptr: int) -> None:
    code = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if code != 0:
        _clear_cuda_error()
        raise EngineError(f"cudaHostUnregister failed with CUDA error {code}")


def _tensors(held: HeldWeights) -> list[torch.Tensor]:
    if isinstance(held, BlockScaled):
        return [held.gate_up, held.down, *held.scales]
    return [held.gate_up, held.down]


def _rebuilt(held: HeldWeights, tensors: list[torch.Tensor]) -> HeldWeights:
    if isinstance(held, BlockScaled):
        return BlockScaled(tensors[0], tensors[1], tuple(tensors[2:]))
    return ExpertWeights(tensors[0], tensors[1])


def _round_up(num_bytes: int, multiple: int) -> int:
    return -(-num_bytes // multiple) * multiple


def footprint(num_bytes: int) -> int:
    """Bytes a locked copy of an expert whose tensors hold `num_bytes` occupies at most (page-rounded, with the
    alignment padding between its tensors)."""
    return _round_up(num_bytes + MAX_PARTS * PART_ALIGN, mmap.PAGESIZE)


def _unlock(unregister: Callable[[int], None], address: int, record: _Locked) -> None:
    """Wait for the last copy out of `record`, then unregister it (a failure is logged, not raised)."""
    try:
        if record.last_copy is not None:
            record.last_copy.synchronize()
        unregister(address)
    except Exception as exc:  # noqa: BLE001 - the copy is dropped either way; nothing else depends on it
        log.warning("could not unlock a %d B expert host copy: %s", record.num_bytes, exc)


def _unlock_all(unregister: Callable[[int], None], locked: dict[int, _Locked]) -> None:
    while locked:
        address, record = locked.popitem()
        _unlock(unregister, address, record)


class PinnedHostCopies:
    """Makes and frees page-locked host copies (`register`/`unregister` default to the CUDA runtime's)."""

    def __init__(
        self,
        register: Callable[[int, int], None] = _cudart_register,
        unregister: Callable[[int], None] = _cudart_unregister,
    ) -> None:
        self.register, self.unregister = register, unregister
        self.locked: dict[int, _Locked] = {}  # mapping address -> its record
        # an owner dropped without close(): unlock before the mappings can be unmapped while registered
        self._finalizer = weakref.finalize(self, _unlock_all, unregister, self.locked)

    @property
    def num_locked_bytes(self) -> int:
        """Host bytes locked now (every live pinned copy's mapping)."""
        return sum(record.num_bytes for record in self.locked.values())

    def pin(self, held: HeldWeights) -> HeldWeights:
        """A page-locked copy of `held` (the caller drops `held` and counts the copy as `footprint`); raises
        EngineError, holding nothing, when the runtime refuses to lock it."""
        tensors = _tensors(held)
        if len(tensors) > MAX_PARTS:
            raise EngineError(f"a host copy of {len(tensors)} tensors; at most {MAX_PARTS} can be pinned")
        offsets, end = [], 0
        for tensor in tensors:
            offsets.append(end)
            end = _round_up(end + tensor.nbytes, PART_ALIGN)
        num_bytes = _round_up(end, mmap.PAGESIZE)
        mapping = mmap.mmap(-1, num_bytes)
        base = torch.frombuffer(mapping, dtype=torch.uint8)
        address = base.data_ptr()
        self.register(address, num_bytes)
        self.locked[address] = _Locked(mapping, num_bytes)
        copies = [
            base[offset : offset + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
            for offset, t in zip(offsets, tensors, strict=True)
        ]
        return _rebuilt(held, copies)

    def is_pinned(self, held: HeldWeights) -> bool:
        """True when `held` is a copy this object locked and has not unlocked."""
        return held.gate_up.untyped_storage().data_ptr() in self.locked

    def record_copy(self, held: HeldWeights, stream: torch.cuda.Stream) -> None:
        """Note an asynchronous copy out of `held` just queued on `stream` (a no-op for a copy not pinned here)."""
        record = self.locked.get(held.gate_up.untyped_storage().data_ptr())
        if record is not None:
            record.last_copy = torch.cuda.Event()
            record.last_copy.record(stream)

    def unpin(self, held: HeldWeights) -> None:
        """Unlock `held` once the last copy out of it has completed (a no-op for a copy not pinned here); the
        tensors stay valid, pageable, while anything still refers to them."""
        address = held.gate_up.untyped_storage().data_ptr()
        record = self.locked.pop(address, None)
        if record is not None:
            _unlock(self.unregister, address, record)

    def close(self) -> None:
        """Unlock every copy still locked (the store is closing)."""
        _unlock_all(self.unregister, self.locked)

"""The disk tier: tensors written as files under a spill directory, one CRC32 per page."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import uuid
import weakref
import zlib

import numpy as np
import torch

from fallbackgate.engine.errors import ChecksumError, EngineError

PAGE_BYTES = 64 * 1024


@dataclasses.dataclass(slots=True, frozen=True)
class SpillRecord:
    """Where a spilled tensor lives and how to check it."""

    path: pathlib.Path  # file holding the raw bytes
    dtype: torch.dtype  # element type
    shape: tuple[int, ...]  # tensor shape
    page_crcs: tuple[int, ...]  # CRC32 of each PAGE_BYTES page, in order

    @property
    def num_bytes(self) -> int:
        return int(np.prod(self.shape)) * torch.empty((), dtype=self.dtype).element_size()


class SpillDir:
    """Writes and reads tensors under one directory; every read verifies every page's checksum."""

    def __init__(self, parent: str | os.PathLike[str]) -> None:
        """Files go into a fresh `fallbackgate-spill-<id>` directory under `parent` (so engines sharing a
        spill directory never collide); it is removed when this object is garbage collected or at exit."""
        self.root = pathlib.Path(parent) / f"fallbackgate-spill-{uuid.uuid4().hex[:12]}"
        try:
            self.root.mkdir(parents=True, exist_ok=False)
            probe = self.root / ".fallbackgate-write-probe"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            raise EngineError(f"spill directory {parent} is not writable: {exc}") from exc
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.root, ignore_errors=True)
        self.is_checksum_verified = True  # tests turn this off to plant a fault

    def close(self) -> None:
        """Remove the directory and everything spilled into it now (the engine is done with it)."""
        self._finalizer()

    def write(self, name: str, tensor: torch.Tensor) -> SpillRecord:
        """Write `tensor` to `<root>/<name>.bin` and return its record."""
        data = tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
        crcs = tuple(zlib.crc32(data[i : i + PAGE_BYTES]) for i in range(0, len(data), PAGE_BYTES))
        path = self.root / f"{name}.bin"
        try:
            path.write_bytes(data)
        except OSError as exc:  # a full disk or a vanished directory: say which, never a bare traceback
            path.unlink(missing_ok=True)
            where = f"spill directory {self.root.parent}"
            raise EngineError(f"{where}: cannot write {len(data)} B ({exc.strerror})") from None
        return SpillRecord(path=path, dtype=tensor.dtype, shape=tuple(tensor.shape), page_crcs=crcs)

    def read(self, record: SpillRecord) -> torch.Tensor:
        """Read a tensor back; raises ChecksumError if any page does not match its CRC."""
        data = record.path.read_bytes()
        if self.is_checksum_verified:
            for page, expected in enumerate(record.page_crcs):
                chunk = data[page * PAGE_BYTES : (page + 1) * PAGE_BYTES]
                if zlib.crc32(chunk) != expected:
                    raise ChecksumError(f"{record.path.name}: page {page} checksum mismatch")
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return raw.view(record.dtype).reshape(record.shape).clone()

    def delete(self, record: SpillRecord) -> None:
        """Remove a spilled file (missing files are fine)."""
        record.path.unlink(missing_ok=True)

"""What prefix reuse names and counts: content hashes of full KV blocks, kept entries, statistics."""

from __future__ import annotations

import dataclasses
import hashlib
import zlib

import torch

from fallbackgate.engine.kv.block import KVBlock

PREFIX_ID = "prefix:"  # pseudo request ids of kept blocks start with it
ROOT_DIGEST = b"fallbackgate-prefix-v1"  # the parent of a request's first block
DEFAULT_SPILL_CAP_BYTES = 1 << 30  # kept blocks off RAM (disk, host) at most; the least recently used go first
DEFAULT_RAM_CAP_BYTES = 256 << 20  # kept blocks on the fast tier (RAM on a CPU) at most; least recent dropped


def chain_hashes(token_ids: list[int], block_size: int, num_blocks: int, known: list[bytes]) -> list[bytes]:
    """The content hashes of the first `num_blocks` full blocks of `token_ids`, extending `known` (a prefix
    of the answer computed before) in place."""
    while len(known) < num_blocks:
        index = len(known)
        parent = known[-1] if known else ROOT_DIGEST
        block = token_ids[index * block_size : (index + 1) * block_size]
        data = torch.tensor(block, dtype=torch.int64).numpy().tobytes()
        known.append(hashlib.blake2b(parent + data, digest_size=16).digest())
    return known[:num_blocks]


def hash_u64(digest: bytes) -> int:
    """A content hash as the trace's uint64 (its first 8 bytes, little-endian)."""
    return int.from_bytes(digest[:8], "little")


def block_crc(block: KVBlock) -> int:
    """CRC32 of a block's device bytes."""
    assert block.device is not None
    return zlib.crc32(block.device.detach().contiguous().cpu().view(torch.uint8).numpy())


@dataclasses.dataclass(slots=True, frozen=True)
class PrefixEntryInfo:
    """What a controller sees of one kept block position (all its layers)."""

    digest: str  # content hash, hex
    num_hits: int  # times requests adopted this prefix block so far
    idle_steps: int  # engine steps since it was kept or last adopted
    num_on_device: int  # layers whose block is in the fast tier
    reuse_share: float = 1.0  # the run's adoptions per kept block position so far, (1 + adopted) / (1 + kept)
    is_session: bool = False  # kept by a request of a client-declared session (a later turn may adopt it)


@dataclasses.dataclass(slots=True)
class KeptEntry:
    """One kept block position: its one-block table's pseudo id, hash, CRCs and use."""

    request_id: str  # pseudo id of its one-block table
    digest: bytes
    crcs: list[int | None]  # per layer: CRC32 of the device bytes when kept (None: not on device then)
    last_step: int
    num_hits: int
    is_session: bool = False  # kept when a request with a session id ended (a block published while its
    # request ran is adopted at once, so the drop rule never asks)


@dataclasses.dataclass(slots=True)
class PrefixStats:
    """What prefix reuse did in a run."""

    num_kept_blocks: int = 0  # block positions kept when their request ended (each: every layer's block)
    num_reused_blocks: int = 0  # block positions adopted by later requests
    num_reused_tokens: int = 0  # prefill tokens skipped by those adoptions
    num_reused_requests: int = 0  # requests that adopted at least one block
    num_reused_resident: int = 0  # adopted layer blocks that were in the fast tier
    num_reused_spilled: int = 0  # adopted layer blocks whose copy was on disk (or host): read exact_load
    num_checksum_failures: int = 0  # kept blocks whose bytes no longer matched their CRC (dropped, not reused)
    num_dropped_blocks: int = 0  # kept block positions dropped (no exact copy left, over the spill cap)
    num_published_blocks: int = 0  # block positions shared while their request still ran (its prefill of them done)
    num_shared_blocks: int = 0  # adoptions of a block another live request held at the time (concurrent sharing)
    num_kept_on_abort: int = 0  # block positions kept when their request was aborted or drop-preempted

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

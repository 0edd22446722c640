"""Engine configuration: one validated slots dataclass."""

from __future__ import annotations

import dataclasses
import enum
import os

import torch

from fallbackgate.engine.hardware import CPU_BOX, HardwareProfile

MIB = 1024 * 1024
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PreemptMode(str, enum.Enum):
    """What preempting a running request does to its KV blocks."""

    SWAP = "swap"  # copy them to host memory, copy back on resume
    RECOMPUTE = "recompute"  # drop them, prefill the prompt and output again on resume


PREEMPT_MODES: tuple[str, ...] = tuple(m.value for m in PreemptMode)


class TierLayout(str, enum.Enum):
    """Which memory tiers an engine has, from its device (see `tier_layout`)."""

    RAM_DISK = "ram_disk"  # CPU: RAM is the one budgeted tier (the "device" pool), the disk the other
    DEVICE_HOST_DISK = "device_host_disk"  # CUDA: device memory, host memory, disk
    EMULATED_DEVICE_HOST_DISK = "emulated_device_host_disk"  # test only: CUDA's three tiers as two RAM budgets


def tier_layout(device: torch.device, is_emulated_device_tier: bool) -> TierLayout:
    """The tier layout of an engine on `device` (emulation only on a CPU)."""
    if device.type != "cpu":
        return TierLayout.DEVICE_HOST_DISK
    return TierLayout.EMULATED_DEVICE_HOST_DISK if is_emulated_device_tier else TierLayout.RAM_DISK


def default_io_threads() -> int:
    """``$FALLBACKGATE_IO_THREADS`` when set; else 2 I/O threads where the machine has more than 2 cores (or an
    accelerator computes), else 0.

    Measured on a 2-core CPU box (the 16-layer OLMoE-shaped benchmark): reads on I/O threads hid half their
    time but slowed the compute they overlap by more (torch's two compute threads spin on both cores), 3.7-4.0
    against 4.5-4.9 tokens/s with every read on the compute thread."""
    given = os.environ.get("FALLBACKGATE_IO_THREADS", "").strip()
    if given:
        if not (given.isascii() and given.isdigit()) or int(given) > 64:
            raise ValueError(f"FALLBACKGATE_IO_THREADS must be a whole number 0..64, got {given!r}")
        return int(given)
    return 2 if (os.cpu_count() or 1) > 2 or torch.cuda.is_available() else 0


@dataclasses.dataclass(kw_only=True, slots=True)
class EngineConfig:
    """Knobs of the mechanism. Budgets are bytes; None means "everything fits"."""

    model_dir: str  # local checkpoint directory
    # expert slots + KV blocks (+ low-bit copies on a CPU) on device; on a CPU the one RAM budget, None: sized
    # from the memory limit (engine/ram.py); on CUDA None: everything fits
    device_budget_bytes: int | None = None
    # expert homes + KV copies in host memory; the rest spills to disk. CUDA (and the emulation) only: on a
    # CPU there is no second RAM tier, so only None or 0
    host_budget_bytes: int | None = None
    spill_dir: str | None = None  # disk tier directory (a temporary directory when None)
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 8  # running requests at most
    max_num_batched_tokens: int = 256  # tokens per forward (prefill chunks + decodes)
    max_model_len: int = 2048  # prompt + output tokens per request
    preempt_mode: str = PreemptMode.SWAP.value  # a PreemptMode value
    expert_lowbit_bits: int = 8  # bits of the low-bit expert copies (0: none)
    profile: HardwareProfile = CPU_BOX  # modeled time
    device: str = "auto"  # "auto", "cpu" or "cuda"
    seed: int = 0  # base seed for sampling
    dtype: str | None = None  # compute dtype override ("float32", "bfloat16", "float16"); None: the checkpoint's
    is_stacked_when_fits: bool = True  # no device budget: each layer's experts stacked on device (no misses at all)
    num_io_threads: int | None = None  # threads reading experts ahead of use; None: `default_io_threads()`
    num_verified_copies_per_step: int = 1  # expert copies checked against the checkpoint after each step
    audit_cache_bytes: int = 256 * MIB  # the audit's own verified expert copies (outside the budgets)
    is_observe: bool = False  # observe mode: decisions recorded, exact actions served
    lowbit_cache_dir: str | None = None  # CPU: low-bit copies persisted here (see lowbit_cache.py); None: none
    lowbit_cache_bytes: int = 8 * 1024 * MIB  # cap of the persisted low-bit copies per checkpoint and bit width
    is_lowbit_prepared: bool = False  # CPU: persist every expert's low-bit copy at build (lowbit_cache_dir)
    is_decode_compiled: bool = False  # decode forwards run as one torch.compile graph (engine/model/compiled.py)
    is_prefix_reused: bool = True  # full KV blocks kept by content hash after their request, reused by prefixes
    prefix_spill_cap_bytes: int = 1024 * MIB  # kept prefix blocks off the fast tier (disk, host) at most
    prefix_ram_cap_bytes: int = 256 * MIB  # kept prefix blocks on the fast tier at most (least recent dropped)
    # test only: on a CPU, emulate CUDA's device/host/disk layout as two RAM budgets (the device tier aliases
    # host copies, cpu_execute offered); never from a policy file or the CLI, named in the summary and ledger
    is_emulated_device_tier: bool = False

    def __post_init__(self) -> None:
        for name in ("device_budget_bytes", "host_budget_bytes"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {value}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})"
            )
        if self.preempt_mode not in PREEMPT_MODES:
            raise ValueError(f"preempt_mode must be one of {list(PREEMPT_MODES)}, got {self.preempt_mode!r}")
        if self.expert_lowbit_bits not in (0, 4, 8):
            raise ValueError(f"expert_lowbit_bits must be 0, 4 or 8, got {self.expert_lowbit_bits}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)} or None, got {self.dtype!r}")
        if self.num_io_threads is None:
            self.num_io_threads = default_io_threads()
        if not 0 <= self.num_io_threads <= 64:
            raise ValueError(f"num_io_threads must be 0..64, got {self.num_io_threads}")
        if not 0 <= self.num_verified_copies_per_step <= 1024:
            raise ValueError(f"num_verified_copies_per_step must be 0..1024, got {self.num_verified_copies_per_step}")
        if self.lowbit_cache_bytes < 0:
            raise ValueError(f"lowbit_cache_bytes must be >= 0, got {self.lowbit_cache_bytes}")
        if self.prefix_spill_cap_bytes < 0:
            raise ValueError(f"prefix_spill_cap_bytes must be >= 0, got {self.prefix_spill_cap_bytes}")
        if self.prefix_ram_cap_bytes < 0:
            raise ValueError(f"prefix_ram_cap_bytes must be >= 0, got {self.prefix_ram_cap_bytes}")
        if self.audit_cache_bytes < 0:
            raise ValueError(f"audit_cache_bytes must be >= 0, got {self.audit_cache_bytes}")
        if self.is_emulated_device_tier and self.device == "cuda":
            raise ValueError("is_emulated_device_tier emulates a device tier on a CPU; the device is cuda")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")

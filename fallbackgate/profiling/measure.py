"""Measure this machine: cold disk reads, host<->device copies, expert compute by size and token count, and
the bundled model's decode step. Each figure is a median of repeated wall-clock timings.

Run through ``fallbackgate profile``; :func:`measure_profile` returns the raw measurements and the fitted
:class:`~fallbackgate.engine.hardware.HardwareProfile`.
"""

from __future__ import annotations

import dataclasses
import itertools
import mmap
import os
import pathlib
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

MIB = 1024 * 1024
CHUNK_BYTES = 16 * MIB  # disk read size: an expert-sized read
EXPERT_SHAPES = ((192, 128), (1024, 512), (2048, 1024))  # (hidden, intermediate): bundled, small, OLMoE-sized
TOKEN_COUNTS = (1, 4, 16, 64)
POOL_BYTES = 192 * MIB  # weights cycled through per expert shape: more than any CPU cache


@dataclasses.dataclass(slots=True)
class ExpertTiming:
    """One measured expert call: a gated MLP of (hidden, intermediate) over `num_tokens` tokens."""

    device: str  # "cpu" or "cuda"
    dtype: str  # weight and activation dtype
    hidden: int  # model width
    intermediate: int  # expert width
    num_tokens: int  # rows through the expert
    seconds: float  # median wall clock of one call

    @property
    def num_params(self) -> int:
        return 3 * self.hidden * self.intermediate


def _median_s(fn: Callable[[], Any], repeats: int, sync: Callable[[], None] = lambda: None) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_disk(directory: pathlib.Path, num_bytes: int) -> tuple[float, float]:
    """(write bytes/s with fsync, cold read bytes/s) of a scratch file in `directory`.

    Pages are dropped with ``posix_fadvise(DONTNEED)`` after the fsync, then read back with ``O_DIRECT``
    (as the engine reads experts) in expert-sized chunks."""
    num_bytes = max(CHUNK_BYTES, num_bytes // CHUNK_BYTES * CHUNK_BYTES)
    payload = os.urandom(CHUNK_BYTES)
    with tempfile.NamedTemporaryFile(dir=directory, prefix="fallbackgate-profile-", delete=True) as handle:
        start = time.perf_counter()
        for _ in range(num_bytes // CHUNK_BYTES):
            handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
        write_rate = num_bytes / (time.perf_counter() - start)
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
        try:
            fd = os.open(handle.name, flags)
        except OSError:  # the file system refuses O_DIRECT: buffered reads of dropped pages
            fd = os.open(handle.name, os.O_RDONLY)
        buffer = mmap.mmap(-1, CHUNK_BYTES)
        try:
            start = time.perf_counter()
            for offset in range(0, num_bytes, CHUNK_BYTES):
                os.preadv(fd, [buffer], offset)
            read_rate = num_bytes / (time.perf_counter() - start)
        finally:
            buffer.close()
            os.close(fd)
    return write_rate, read_rate


def measure_copies(device: torch.device, num_bytes: int) -> tuple[float, float]:
    """(host->device, device->host) bytes/s of one `num_bytes` copy (pinned host memory on CUDA)."""
    is_cuda = device.type == "cuda"
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=is_cuda)
    host.fill_(1)
    target = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    sync = torch.cuda.synchronize if is_cuda else (lambda: None)
    to_device = _median_s(lambda: target.copy_(host, non_blocking=is_cuda), 5, sync)
    to_host = _median_s(lambda: host.copy_(target, non_blocking=is_cuda), 5, sync)
    return num_bytes / to_device, num_bytes / to_host


def _expert_call(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = torch.nn.functional.linear(x, gate_up).chunk(2, dim=-1)
    return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down)


def measure_experts(
    device: torch.device, dtype: torch.dtype, shapes=EXPERT_SHAPES, tokens=TOKEN_COUNTS
) -> list[ExpertTiming]:
    """Wall time of one SwiGLU expert call (gate_up, SiLU·up, down: the engine's expert kernel sequence).

    Calls cycle over copies of the weights totalling at least ``POOL_BYTES``, so each call streams its
    weights from memory as a cold expert does rather than from the CPU's caches."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = []
    for hidden, inter in shapes:
        expert_bytes = 3 * hidden * inter * torch.finfo(dtype).bits // 8
        num_copies = max(2, -(-POOL_BYTES // expert_bytes))
        pool = [
            (
                torch.randn(2 * inter, hidden, dtype=dtype, device=device),
                torch.randn(hidden, inter, dtype=dtype, device=device),
            )
            for _ in range(num_copies)
        ]
        for num in tokens:
            x = torch.randn(num, hidden, dtype=dtype, device=device)

            turns = itertools.cycle(pool)
            seconds = _median_s(lambda x=x, turns=turns: _expert_call(x, *next(turns)), max(15, num_copies), sync)
            out.append(ExpertTiming(device.type, str(dtype).removeprefix("torch."), hidden, inter, num, seconds))
    return out


def measure_decode_step(device: torch.device, num_steps: int = 20) -> tuple[float, int, int]:
    """(median seconds of one batch-1 decode step of the bundled model through transformers, its layers, its
    layers with routed experts)."""
    import transformers

    from fallbackgate.tinymoe import CHECKPOINT_DIR

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(CHECKPOINT_DIR).to(device).eval()
    cache = transformers.DynamicCache(config=model.config)
    token = torch.tensor([[1]], device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        model(input_ids=torch.ones(1, 16, dtype=torch.long, device=device), cache=cache, use_cache=True)
        seconds = _median_s(lambda: model(input_ids=token, cache=cache, use_cache=True), num_steps, sync)
    num_layers = int(model.config.num_hidden_layers)
    return seconds, num_layers, num_layers - len(getattr(model.config, "mlp_only_layers", None) or [])


def measure_engine_steps(
    device: torch.device, batch: int = 6, num_steps: int = 12
) -> tuple[float, float, int, int, int]:
    """(median seconds of the engine's decode step on the bundled model at batch 1, at `batch`, the model's
    MoE layers, routed experts per layer, experts per token): what the engine adds around the model's own
    forward (scheduling, per-request attention, sampling, events) shows up against
    :func:`measure_decode_step`."""
    from fallbackgate.engine.baseline.api import ExactController
    from fallbackgate.engine.config import EngineConfig
    from fallbackgate.engine.engine import Engine
    from fallbackgate.engine.sequence import SamplingParams
    from fallbackgate.tinymoe import CHECKPOINT_DIR

    config = EngineConfig(
        model_dir=str(CHECKPOINT_DIR), device="cuda" if device.type == "cuda" else "cpu", num_io_threads=0
    )
    engine = Engine(config, ExactController())
    medians = []
    for num in (1, batch):
        for i in range(num):
            engine.add_request(list(range(1, 17)), SamplingParams(max_new_tokens=num_steps + 2), f"probe-{num}-{i}")
        engine.step()  # the prefill
        times = []
        while engine.has_unfinished():
            started = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - started)
        medians.append(statistics.median(times))
    engine.close()
    first = next(iter(engine.loaded_experts.values()))
    top_k = int(getattr(engine.model_config, "num_experts_per_tok", 1))
    return medians[0], medians[1], len(engine.loaded_experts), int(first.num_experts), top_k

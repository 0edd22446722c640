"""What the engine itself adds to an expert miss beyond its disk read, measured through the real store.

The bundled model's engine runs with a few expert slots and the default I/O threads; every miss takes the
least recently placed expert off device and places the missing one (``ExpertStore.evict`` and ``place``: the
reservation, the read through the engine's one I/O scheduler, the parts' assembly, the manifest checksum and
the copy into the slot). Per miss it times the whole fetch on the waiting thread and, from the scheduler's
own records, the read's submission to arrival; their mean difference is the engine's overhead per miss, what
``fallbackgate trace validate --device profile`` adds to the disk's time (a recorded run's miss wait includes
it; the I/O path points of :mod:`fallbackgate.profiling.engine_io` do not).
"""

from __future__ import annotations

import collections
import random
import statistics
import time
from typing import Any

from fallbackgate.engine.io import IOOp

NUM_MISSES = 48
NUM_SLOTS = 4  # expert slots the measuring engine holds (every layer's experts compete for them)


def measure_engine_misses(num_misses: int = NUM_MISSES, seed: int = 0) -> dict[str, Any]:
    """``{"num_misses", "num_bytes", "mean_wait_s", "mean_io_s", "overhead_s", "median_overhead_s"}``: the
    whole fetch per miss (mean), its read's submission to arrival (mean), and their difference."""
    from fallbackgate.engine.baseline.api import ExactController
    from fallbackgate.engine.config import EngineConfig
    from fallbackgate.engine.engine import Engine
    from fallbackgate.tinymoe import CHECKPOINT_DIR

    sizing = Engine(EngineConfig(model_dir=str(CHECKPOINT_DIR), device="cpu"), ExactController())
    bytes_per_expert = sizing.expert_store.bytes_per_expert
    sizing.close()
    config = EngineConfig(
        model_dir=str(CHECKPOINT_DIR), device="cpu", device_budget_bytes=NUM_SLOTS * bytes_per_expert + (1 << 20)
    )
    engine = Engine(config, ExactController())
    store, rng = engine.expert_store, random.Random(seed)
    keys = sorted(store.entries)
    placed: collections.deque = collections.deque(k for k in keys if store.is_on_device(k))
    engine.io.take_completed()
    waits, ios = [], []
    try:
        while len(waits) < num_misses:
            key = rng.choice(keys)
            if store.is_on_device(key):
                continue
            while placed and not store.can_place(key):
                store.evict(placed.popleft())
            started = time.perf_counter_ns()
            store.place(key)
            waits.append(time.perf_counter_ns() - started)
            placed.append(key)
            reads = [r for r in engine.io.take_completed() if r.op is IOOp.READ and r.end_ns]
            ios.append(max(r.end_ns for r in reads) - min(r.submit_ns for r in reads) if reads else 0)
    finally:
        engine.close()
    overheads = [w - i for w, i in zip(waits, ios, strict=True)]
    return {
        "num_misses": len(waits),
        "num_bytes": bytes_per_expert,
        "mean_wait_s": statistics.fmean(waits) / 1e9,
        "mean_io_s": statistics.fmean(ios) / 1e9,
        "overhead_s": max(statistics.fmean(overheads), 0.0) / 1e9,
        "median_overhead_s": max(statistics.median(overheads), 0.0) / 1e9,
    }

"""The garbage collector while an engine serves.

A full (generation-2) collection walks every object the process tracks: the model's modules, torch's and
transformers' own, and in a long process (a sweep of hundreds of runs) everything it kept. Measured in a sweep
process: 273–472 ms per collection, landing inside single decode steps (steps of 0.38–0.58 s among 6–12 ms
ones, no I/O waited), i.e. in P99 TPOT. While serving, the heap as it was at the start is therefore moved out
of the collector's reach (``gc.freeze``, after one collection so that no garbage is frozen), as vLLM's engine
core does after start-up; objects made while serving are collected as usual. When the last serving loop
ends the heap is handed back (``gc.unfreeze``).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_num_serving = 0  # serving loops running now (nested or in threads)
_lock = threading.Lock()  # guards _num_serving and the freeze/unfreeze that follow its changes


def hold() -> None:
    """A serving loop starts: collect once, then freeze the heap (while another loop serves, only freeze)."""
    global _num_serving
    with _lock:
        if _num_serving == 0:
            gc.collect()
        gc.freeze()
        _num_serving += 1


def release() -> None:
    """A serving loop ended: when it was the last, hand the frozen objects back to the collector."""
    global _num_serving
    with _lock:
        _num_serving = max(0, _num_serving - 1)
        if _num_serving == 0:
            gc.unfreeze()


@contextlib.contextmanager
def frozen_while_serving() -> Iterator[None]:
    """`hold` for the duration of the block, then `release`."""
    hold()
    try:
        yield
    finally:
        release()

"""Running one simulation configuration over a trace, and many in parallel processes (see
:mod:`fallbackgate.tracing.simulate` for what is simulated and what is simplified)."""

from __future__ import annotations

import concurrent.futures
import os
import sys
from collections.abc import Iterator
from typing import Any

import tqdm

from fallbackgate.tracing.simulate import SimulationConfig
from fallbackgate.tracing.simulate_input import SimulationInput, load_input
from fallbackgate.tracing.simulator import GIB, Simulator

_INPUT: SimulationInput | None = None


def _load(path: str) -> None:
    global _INPUT
    _INPUT = load_input(path)


def _run_one(config: SimulationConfig) -> dict[str, Any]:
    assert _INPUT is not None
    try:
        return Simulator(_INPUT, config).run()
    except Exception as exc:  # a controller failing on one configuration stays that configuration's result
        return {"controller": config.controller, "budget_gib": config.budget_bytes / GIB, "device": config.device.name,
                "expert_fraction": config.expert_fraction, "error": f"{type(exc).__name__}: {exc}"}  # fmt: skip


def iter_simulations(
    path: str, configs: list[SimulationConfig], jobs: int | None = None
) -> Iterator[tuple[int, dict[str, Any]]]:
    """(configuration index, result) of every configuration over the trace at ``path`` as each finishes, in
    ``jobs`` processes (default: the CPUs). Closing the generator early cancels what has not started."""
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(configs)))
    if jobs == 1:
        _load(path)
        for index, config in enumerate(configs):
            yield index, _run_one(config)
        return
    with concurrent.futures.ProcessPoolExecutor(jobs, initializer=_load, initargs=(path,)) as pool:
        futures = {pool.submit(_run_one, config): index for index, config in enumerate(configs)}
        try:
            for future in concurrent.futures.as_completed(futures):
                yield futures[future], future.result()
        finally:
            for future in futures:
                future.cancel()


def simulate_many(
    path: str, configs: list[SimulationConfig], jobs: int | None = None, progress: bool = False
) -> list[dict[str, Any]]:
    """Every configuration over the trace at ``path``, in ``jobs`` processes (default: the CPUs); results in
    configuration order. ``progress`` draws a bar on stderr (configurations done)."""
    results: list[dict[str, Any]] = [{} for _ in configs]
    with tqdm.tqdm(total=len(configs), unit="config", disable=not progress, file=sys.stderr) as bar:
        for index, result in iter_simulations(path, configs, jobs):
            results[index] = result
            bar.update()
    return results

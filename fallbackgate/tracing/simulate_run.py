"""Running one simulation configuration over a trace, and many in parallel processes (see
:mod:`fallbackgate.tracing.simulate` for what is simulated and what is simplified)."""

from __future__ import annotations

import concurrent.futures
import os
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import tqdm

from fallbackgate.controllers.registry import make_controller
from fallbackgate.tracing.simulate import SimulationConfig
from fallbackgate.tracing.simulate_input import SimulationInput, load_input
from fallbackgate.tracing.simulator import GIB, Simulator

_INPUT: SimulationInput | None = None


def _load(path: str) -> None:
    global _INPUT
    _INPUT = load_input(path)


def _run_one(config: SimulationConfig) -> dict[str, Any]:
    return _run_group([config])[0]


def _run_group(configs: list[SimulationConfig]) -> list[dict[str, Any]]:
    """Configurations that differ only in their device model. A controller that decides without the profile
    (``Controller.reads_profile`` False) makes the same decisions on every device, so one decision pass is
    priced on each device; any other runs once per configuration."""
    assert _INPUT is not None
    results: list[dict[str, Any]] = []
    shared: tuple[Simulator, np.ndarray, np.ndarray] | None = None
    for config in configs:
        try:
            if shared is None:
                simulator = Simulator(_INPUT, config)
                reads, moved = simulator.decide()
                if not simulator.controller.reads_profile:
                    shared = simulator, reads, moved
            else:
                simulator, reads, moved = shared
                simulator.config = config
            results.append(simulator.result(config.device.stall_ns(reads, moved)))
        except Exception as exc:  # a controller failing on one configuration stays that configuration's result
            results.append({"controller": config.controller, "budget_gib": config.budget_bytes / GIB,
                            "device": config.device.name, "expert_fraction": config.expert_fraction,
                            "expert_bytes_scale": config.expert_bytes_scale, "kv_bytes_scale": config.kv_bytes_scale,
                            "error": f"{type(exc).__name__}: {exc}"})  # fmt: skip
    return results


def num_decision_passes(configs: list[SimulationConfig]) -> int:
    """How many decision passes `iter_simulations` makes for `configs` (one per device group of a profile-free
    controller, one per configuration otherwise)."""
    is_shared = {k: not make_controller(k).reads_profile for k in {c.controller for c in configs}}
    return sum(1 if is_shared[configs[g[0]].controller] else len(g) for g in _device_groups(configs))


def _device_groups(configs: list[SimulationConfig]) -> list[list[int]]:
    """Indices of the configurations that differ only in their device model, in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for index, c in enumerate(configs):
        key = (c.controller, c.budget_bytes, c.expert_fraction, c.expert_bytes_scale, c.kv_bytes_scale)
        groups.setdefault(key, []).append(index)
    return list(groups.values())


def iter_simulations(
    path: str, configs: list[SimulationConfig], jobs: int | None = None
) -> Iterator[tuple[int, dict[str, Any]]]:
    """(configuration index, result) of every configuration over the trace at ``path`` as each finishes, in
    ``jobs`` processes (default: the CPUs). Closing the generator early cancels what has not started."""
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(configs)))
    if jobs == 1:
        _load(path)
        for group in _device_groups(configs):
            yield from zip(group, _run_group([configs[i] for i in group]), strict=True)
        return
    with concurrent.futures.ProcessPoolExecutor(jobs, initializer=_load, initargs=(path,)) as pool:
        groups = _device_groups(configs)
        futures = {pool.submit(_run_group, [configs[i] for i in group]): group for group in groups}
        try:
            for future in concurrent.futures.as_completed(futures):
                yield from zip(futures[future], future.result(), strict=True)
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

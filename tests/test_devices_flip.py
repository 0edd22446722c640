"""``bench.devices_flip``' summary: joint's stall gains over the best static split of each seed and over two
LRUs, per device and cell, and how often joint stalls least."""

from __future__ import annotations

import pytest

from fallbackgate.bench.devices_flip import controllers, summarize


def _cell(seed: int, joint: float, statics: tuple[float, float, float], lru: float) -> dict:
    shares = zip((0.1, 0.3, 0.5), statics, strict=True)
    stalls = {"joint": joint, "two LRUs": lru} | {f"static KV {kv:g}": s for kv, s in shares}
    by_label = {k: {"stall_s": v, "p99_tpot_ms": 1.0} for k, v in stalls.items()}
    return {"workload": "mixed", "seed": seed, "ram_frac": 0.25, "devices": {"waits": by_label}}


def test_every_sweep_controller_is_simulated() -> None:
    assert [label for label, _, _ in controllers()] == ["joint", "two LRUs", "static KV 0.1", "static KV 0.3",
                                                        "static KV 0.5"]  # fmt: skip
    assert [share for *_, share in controllers()][2:] == [0.9, 0.7, 0.5]


def test_gains_are_over_each_seeds_best_static_split_and_the_lrus() -> None:
    row = summarize([_cell(0, 1.0, (4.0, 2.0, 3.0), 4.0), _cell(1, 3.0, (2.0, 5.0, 6.0), 6.0)])["waits"]["mixed@0.25"]
    assert row["gain_vs_best static"]["mean"] == pytest.approx(((1 - 1 / 2) + (1 - 3 / 2)) / 2)
    assert row["gain_vs_two LRUs"]["mean"] == pytest.approx(((1 - 1 / 4) + (1 - 3 / 6)) / 2)
    assert row["stall_s"] == {"joint": 2.0, "best static": 2.0, "two LRUs": 5.0}
    assert row["joint_least_share"] == 0.5  # seed 1: the static split at KV 0.1 stalls less

"""Shared fixtures: random checkpoints are built once per session."""

from __future__ import annotations

import pathlib

import pytest

from tests.checkpoints import make_checkpoint


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[tuple[str, int], pathlib.Path] = {}

    def make(arch: str = "qwen3_moe", seed: int = 0) -> pathlib.Path:
        key = (arch, seed)
        if key not in cache:
            cache[key] = make_checkpoint(arch, tmp_path_factory.mktemp(f"{arch}-{seed}"), seed)
        return cache[key]

    return make

"""Shared fixtures: random checkpoints are built once per session."""

from __future__ import annotations

import os
import pathlib

import pytest

from tests.checkpoints import make_checkpoint

# every test (and every command a test runs) predicts with one fixed profile, not this machine's measurement
FIXED_PROFILE = pathlib.Path(__file__).parent / "data" / "fixed_profile.json"
os.environ["FALLBACKGATE_PROFILE"] = str(FIXED_PROFILE)
# and reads experts on the compute thread unless a test asks for I/O threads, on any number of cores (the
# default turns read-ahead on above 2 cores; the tests that need it set num_io_threads themselves)
os.environ["FALLBACKGATE_IO_THREADS"] = "0"


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[tuple[str, int], pathlib.Path] = {}

    def make(arch: str = "qwen3_moe", seed: int = 0) -> pathlib.Path:
        key = (arch, seed)
        if key not in cache:
            cache[key] = make_checkpoint(arch, tmp_path_factory.mktemp(f"{arch}-{seed}"), seed)
        return cache[key]

    return make

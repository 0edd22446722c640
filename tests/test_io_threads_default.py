"""How many I/O threads an engine reads experts ahead with when its config does not say:
``$FALLBACKGATE_IO_THREADS``, else 2 above 2 cores (or with an accelerator), else 0."""

from __future__ import annotations

import pytest
import torch

from fallbackgate.engine import config as engine_config
from fallbackgate.engine.config import EngineConfig, default_io_threads


def test_the_environment_sets_the_default_and_bad_values_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FALLBACKGATE_IO_THREADS", "3")
    assert default_io_threads() == 3
    assert EngineConfig(model_dir="unused").num_io_threads == 3
    assert EngineConfig(model_dir="unused", num_io_threads=1).num_io_threads == 1  # the config wins
    for bad in ("two", "-1", "1.5", "²", "65"):
        monkeypatch.setenv("FALLBACKGATE_IO_THREADS", bad)
        with pytest.raises(ValueError, match="FALLBACKGATE_IO_THREADS must be a whole number 0..64"):
            default_io_threads()


def test_without_the_environment_the_core_count_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FALLBACKGATE_IO_THREADS")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for cores, threads in ((1, 0), (2, 0), (3, 2), (16, 2)):
        monkeypatch.setattr(engine_config.os, "cpu_count", lambda cores=cores: cores)
        assert default_io_threads() == threads

"""Where the installed sub-packages live on disk (for their data files), found without importing them."""

from __future__ import annotations

import importlib.util
import pathlib


def package_dir(name: str) -> pathlib.Path:
    """The directory of package `name` (e.g. ``fallbackgate.evals``), editable or installed."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {name!r} is not installed")
    return pathlib.Path(next(iter(spec.submodule_search_locations))).resolve()

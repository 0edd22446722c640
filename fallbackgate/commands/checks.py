"""Checks commands make on their arguments before doing anything."""

from __future__ import annotations

import os
import pathlib


def check_output_path(path: str, flag: str) -> None:
    """The directory an output file goes to exists and is writable (checked before any work)."""
    target = pathlib.Path(path)
    if target.is_dir():
        raise ValueError(f"{flag} {path}: is a directory; give a file path")
    parent = target.parent if str(target.parent) else pathlib.Path(".")
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{flag} {path}: directory {parent} is not writable")

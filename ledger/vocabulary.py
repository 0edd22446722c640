"""The engine's tag and exactness names as the ledger stores them, for readers that do not import the engine
(the dashboard); only :mod:`fallbackgate.engine.tags` is imported, so reading these loads no torch."""

from __future__ import annotations

from fallbackgate.engine.tags import TAG_EXACTNESS, TAGS_BY_EXACTNESS, Exactness

EXACTNESS: dict[str, str] = {t.value: e.value for t, e in TAG_EXACTNESS.items()}
"""Tag name -> exactness name."""
EXACT_TAG_NAMES: tuple[str, ...] = tuple(t for t, e in EXACTNESS.items() if e == Exactness.EXACT.value)
EXACTNESS_NAMES: tuple[str, ...] = tuple(e.value for e in Exactness)
"""Exactness names, most exact first: the ``objects_<exactness>`` columns of the run listings."""
TAG_NAMES: tuple[str, ...] = tuple(t.value for t in TAGS_BY_EXACTNESS)
"""Tag names as the engine writes them, exact first and approximate last: the order reports show."""

"""A change log that readers follow with cursors: what changed since they last looked, never a full walk.

The expert store records every key whose device or host copy came or went (its residency, and so its home
tier); the controllers' priority structures and the copy verifier read the keys recorded since their own
cursor, so their per-step work follows what changed, not how many experts exist. The log keeps a bounded
tail: a reader whose cursor fell off it is told so (``None``) and rebuilds from a full walk once.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

MIN_KEPT = 1024  # entries the log keeps at least before it drops its oldest half


class ChangeLog(Generic[K]):
    """Append-only keys with absolute positions; the oldest half is dropped once more than `max_kept` are held."""

    __slots__ = ("_base", "_entries", "max_kept")

    def __init__(self, max_kept: int = MIN_KEPT) -> None:
        self.max_kept = max(MIN_KEPT, max_kept)
        self._entries: list[K] = []
        self._base = 0  # absolute position of _entries[0]

    @property
    def cursor(self) -> int:
        """The position after the newest entry (what a reader that has seen everything holds)."""
        return self._base + len(self._entries)

    def record(self, key: K) -> None:
        """Append `key` (amortized O(1))."""
        self._entries.append(key)
        if len(self._entries) > self.max_kept:
            half = len(self._entries) // 2
            del self._entries[:half]
            self._base += half

    def extend(self, keys: Iterable[K]) -> None:
        """Append every key of `keys` (amortized O(1) each)."""
        self._entries.extend(keys)
        if len(self._entries) > self.max_kept:
            half = len(self._entries) // 2
            del self._entries[:half]
            self._base += half

    def since(self, cursor: int) -> tuple[list[K] | None, int]:
        """(keys recorded at `cursor` and after, oldest first, or None when the log no longer reaches back to
        `cursor` or `cursor` is negative: the reader must rebuild), and the new cursor."""
        if cursor < self._base or cursor > self.cursor:
            return None, self.cursor
        return self._entries[cursor - self._base :], self.cursor

"""Stop strings: where one first occurs in generated text, and how much text may be sent before more comes.

The engine loop ends a request at the first occurrence (its text is cut before it); a stream holds back
the end of the text that could still become a stop string, so no text past a stop is ever sent.
"""

from __future__ import annotations


class StopStrings:
    """The stop strings of one request."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)  # non-empty strings, in the request's order
        self.longest = max((len(s) for s in self.stops), default=0)  # characters of the longest one

    def __bool__(self) -> bool:
        return bool(self.stops)

    def first(self, text: str, start: int = 0) -> int | None:
        """The index in `text` where the earliest stop string begins (searching from `start`), or None."""
        found = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def search_start(self, num_checked_chars: int) -> int:
        """Where to search again after `num_checked_chars` characters held no stop: a stop string may end
        in the new text and begin up to its length earlier."""
        return max(0, num_checked_chars - self.longest + 1)

    def num_sendable(self, text: str) -> int:
        """How many leading characters of `text` (which holds no stop string) can be sent now: all but the
        longest suffix that is the start of a stop string."""
        for size in range(min(self.longest - 1, len(text)), 0, -1):
            tail = text[-size:]
            if any(s.startswith(tail) for s in self.stops):
                return len(text) - size
        return len(text)

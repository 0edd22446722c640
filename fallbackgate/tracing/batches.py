"""Steps' rows gathered into larger batches before they reach the :class:`TraceWriter`: one ``append`` per
table every ``max_rows`` rows instead of one per table per step (the writer's checks cost per call).
Request ids become run-wide codes as rows arrive; a flush hands the writer only the names its rows use."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fallbackgate.tracing.schema import TraceTable
from fallbackgate.tracing.writer import Indexed, TraceWriter


class RowBatches:
    """Per table, the column batches of recent steps, concatenated and appended on :meth:`flush`."""

    def __init__(self, writer: TraceWriter, max_rows: int = 32768) -> None:
        self.writer, self.max_rows = writer, max_rows
        self.codes: dict[str, int] = {}  # request id -> run-wide code
        self.names: list[str] = []  # code -> request id
        self.pending: dict[TraceTable, list[tuple[int, dict[str, Any]]]] = {}  # table -> (rows, batch) not yet appended
        self.num_pending = 0  # rows in them
        self._last_map: tuple[tuple[str, ...], dict[str, int]] = ((), {})  # the last code_map's names and result

    def request_codes(self, names: Sequence[str]) -> np.ndarray:
        """The run-wide codes of ``names`` (new ones added)."""
        out = np.empty(len(names), dtype=np.int64)
        for i, name in enumerate(names):
            code = self.codes.get(name)
            if code is None:
                code = self.codes[name] = len(self.names)
                self.names.append(name)
            out[i] = code
        return out

    def code_map(self, names: tuple[str, ...]) -> dict[str, int]:
        """``names``' run-wide codes by name (new ones added); the last batch's map is reused (decode steps
        repeat their batch). The map is shared: callers must not change it."""
        if names != self._last_map[0]:
            self._last_map = (names, dict(zip(names, self.request_codes(names).tolist(), strict=True)))
        return self._last_map[1]

    def add(self, table: TraceTable, num_rows: int, columns: dict[str, Any]) -> None:
        """Keep one batch (its ``request`` column, if any, already run-wide codes); flush when enough wait."""
        self.pending.setdefault(table, []).append((num_rows, columns))
        self.num_pending += num_rows
        if self.num_pending >= self.max_rows:
            self.flush()

    def flush(self) -> None:
        """Append every kept batch, one call per table."""
        for table, batches in self.pending.items():
            columns: dict[str, Any] = {}
            for name in batches[0][1]:
                parts = [b[name] for _, b in batches]
                if all(part is None for part in parts):
                    columns[name] = None
                    continue
                joined = _join(parts, [n for n, _ in batches])
                if name == "request":
                    used, index = np.unique(joined, return_inverse=True)
                    joined = Indexed([self.names[c] for c in used.tolist()], index.reshape(-1))
                columns[name] = joined
            self.writer.append(table, **columns)
        self.pending.clear()
        self.num_pending = 0


def _join(parts: list[Any], num_rows: list[int]) -> np.ndarray:
    """One column of several batches; a batch without it (None) or with nulls (a masked array) makes the
    joined column masked there."""
    if not any(part is None or isinstance(part, np.ma.MaskedArray) for part in parts):
        return np.concatenate([np.asarray(part) for part in parts])
    dtype = next(np.asarray(part).dtype for part in parts if part is not None)
    pairs = list(zip(parts, num_rows, strict=True))
    data = [np.zeros(n, dtype) if part is None else np.ma.getdata(part) for part, n in pairs]
    masks = [np.ones(n, bool) if part is None else np.ma.getmaskarray(part) for part, n in pairs]
    return np.ma.MaskedArray(np.concatenate(data), mask=np.concatenate(masks))

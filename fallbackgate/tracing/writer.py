"""Writing a trace directory: column batches in, Parquet row groups out, ``metadata.json`` on close.

Writers hand whole columns (numpy arrays, torch tensors, sequences) per call, never one access at a time;
batches are checked and buffered per table and handed, as one row group, to the writer's
:class:`~fallbackgate.tracing.sink.ParquetSink` (which converts and writes on its own thread) once
:attr:`TraceWriter.row_group_rows` rows are waiting (and on :meth:`TraceWriter.close`). Metadata is written
last, so a directory without ``metadata.json`` is a trace whose writer did not close.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import importlib.metadata
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import numpy as np
import pyarrow as pa

from fallbackgate.tracing.schema import (
    FORMAT_NAME,
    FORMAT_VERSION,
    METADATA_FILE,
    TABLES,
    VOCABULARIES,
    Column,
    TraceFormatError,
    TraceTable,
)
from fallbackgate.tracing.sink import ParquetSink

__all__ = ["Indexed", "Names", "TraceFormatError", "TraceWriter", "checked_column", "to_numpy"]


@dataclasses.dataclass(slots=True, frozen=True)
class Indexed:
    """A string column given as a few names and, per row, an index into them (cheap for request ids)."""

    names: Sequence[str]  # the distinct values
    index: Any  # [rows] int: each row's name


class Names:
    """A growing name -> code dictionary of one dictionary-encoded string column."""

    def __init__(self) -> None:
        self.codes: dict[str, int] = {}  # name -> code
        self.names: list[str] = []  # code -> name

    def code_of(self, names: Sequence[Any]) -> np.ndarray:
        """The codes of ``names``, adding new ones."""
        out = np.empty(len(names), dtype=np.int32)
        for i, name in enumerate(names):
            key = str(name)
            code = self.codes.get(key)
            if code is None:
                code = self.codes[key] = len(self.names)
                self.names.append(key)
            out[i] = code
        return out


def to_numpy(values: Any) -> Any:
    """A torch tensor as a numpy array (detached, on the CPU); anything else unchanged."""
    if hasattr(values, "detach"):  # a torch tensor, without importing torch here
        return values.detach().cpu().numpy()
    return values


def _codes(column: Column, arr: np.ndarray, where: str) -> np.ndarray:
    """A fixed-vocabulary column's values as int32 codes into its vocabulary (names or codes accepted)."""
    vocabulary = VOCABULARIES[column.vocabulary]
    if arr.dtype.kind in "iu":
        if arr.size and (arr.min() < 0 or arr.max() >= len(vocabulary)):
            raise TraceFormatError(f"{where}: codes must index {vocabulary}, got {arr.min()}..{arr.max()}")
        return arr.astype(np.int32)
    unique, inverse = np.unique(np.array([getattr(v, "value", v) for v in arr.tolist()], dtype=object).astype(str),
                                return_inverse=True)  # fmt: skip
    index = {name: i for i, name in enumerate(vocabulary)}
    unknown = sorted(str(u) for u in unique if u not in index)
    if unknown:
        raise TraceFormatError(f"{where}: unknown value(s) {unknown[:5]}; known: {vocabulary}")
    return np.array([index[u] for u in unique], dtype=np.int32)[inverse.reshape(-1)]


def _nullable_objects(column: Column, arr: np.ndarray, where: str) -> tuple[np.ndarray, np.ndarray]:
    """A numeric column given as Python objects with None for empty rows."""
    mask = np.array([v is None for v in arr.tolist()], dtype=bool)
    if mask.any() and not column.is_nullable:
        raise TraceFormatError(f"{where}: is required (found empty rows)")
    try:
        data = np.array([0 if v is None else v for v in arr.tolist()])
    except (TypeError, ValueError) as exc:
        raise TraceFormatError(f"{where}: cannot be read as {column.type}: {exc}") from exc
    if data.dtype.kind not in "biuf":
        raise TraceFormatError(f"{where}: cannot be read as {column.type} (got dtype {data.dtype})")
    return data, mask


def checked_column(
    column: Column, values: Any, num_rows: int, where: str, names: Names | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    """(data, null mask or None) of one column of a batch, checked cheaply; raises TraceFormatError. Strings of
    dictionary columns without a vocabulary become codes into ``names``."""
    if isinstance(values, Indexed):
        index = np.asarray(to_numpy(values.index)).astype(np.int64)
        if index.shape != (num_rows,) or (num_rows and (index.min() < 0 or index.max() >= len(values.names))):
            raise TraceFormatError(f"{where}: the index must be {num_rows} rows into {len(values.names)} names")
        return names.code_of(values.names)[index], None
    if values is None:
        if not column.is_nullable:
            raise TraceFormatError(f"{where}: is required")
        kind = np.int32 if pa.types.is_dictionary(column.type) else object if pa.types.is_string(column.type) else None
        return np.zeros(num_rows, dtype=kind or column.type.to_pandas_dtype()), np.ones(num_rows, dtype=bool)
    values = to_numpy(values)
    mask = np.ma.getmaskarray(values) if isinstance(values, np.ma.MaskedArray) else None
    arr = np.asarray(values.data if isinstance(values, np.ma.MaskedArray) else values)
    if arr.ndim != 1 or len(arr) != num_rows:
        raise TraceFormatError(f"{where}: has {len(arr) if arr.ndim else 0} rows, the batch's first has {num_rows}")
    if column.vocabulary:
        return _codes(column, arr, where), mask
    if pa.types.is_dictionary(column.type) or pa.types.is_string(column.type):
        if arr.dtype.kind not in "USO":
            raise TraceFormatError(f"{where}: expected strings, got dtype {arr.dtype}")
        if names is None:
            return arr.astype(object), mask
        unique, inverse = np.unique(arr.astype(str), return_inverse=True)
        return names.code_of(unique.tolist())[inverse.reshape(-1)], mask
    if arr.dtype.kind == "O":
        return _nullable_objects(column, arr, where)
    if arr.dtype.kind not in "biuf":
        raise TraceFormatError(f"{where}: cannot be read as {column.type} (got dtype {arr.dtype})")
    return arr, mask


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "value"):  # enums
        return value.value
    raise TypeError(f"metadata value {value!r} is not JSON")


@functools.cache
def _package_version() -> str:
    try:
        return importlib.metadata.version("fallbackgate")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class TraceWriter:
    """Writes one trace directory (format v1). Use as a context manager, or call :meth:`close`."""

    def __init__(self, directory: str | os.PathLike[str], metadata: Mapping[str, Any], row_group_rows: int = 65536):
        self.directory = Path(directory)
        if self.directory.exists() and (not self.directory.is_dir() or any(self.directory.iterdir())):
            raise TraceFormatError(f"{self.directory}: a trace directory must be new or empty")
        if row_group_rows < 1:
            raise TraceFormatError(f"row_group_rows must be at least 1, got {row_group_rows}")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.metadata = dict(metadata)  # model shape, budgets, controller, profile, workload, source, ...
        self.row_group_rows = row_group_rows
        self._pending: dict[TraceTable, list[list[tuple[np.ndarray, np.ndarray | None]]]] = {
            t: [] for t in TraceTable
        }  # per table: per batch, per column (data, null mask)
        self._names = {(t, c.name): Names() for t in TraceTable for c in TABLES[t]
                       if pa.types.is_dictionary(c.type) and not c.vocabulary}  # fmt: skip
        self._num_pending: dict[TraceTable, int] = dict.fromkeys(TraceTable, 0)
        self._num_rows: dict[TraceTable, int] = dict.fromkeys(TraceTable, 0)  # rows handed to the sink
        self._sink = ParquetSink(self.directory)
        self.is_closed = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def append(self, table: TraceTable | str, **columns: Any) -> int:
        """Buffer one batch of rows of ``table`` (every column by name, same length); returns its row count."""
        if self.is_closed:
            raise TraceFormatError(f"{self.directory}: the trace is closed")
        table = TraceTable(table)
        specs = TABLES[table]
        unknown = sorted(set(columns) - {c.name for c in specs})
        if unknown:
            raise TraceFormatError(f"{table.value}: unknown column(s) {unknown}")
        given = [columns[c.name] for c in specs if columns.get(c.name) is not None]
        if not given:
            raise TraceFormatError(f"{table.value}: a batch needs its columns")
        first = given[0].index if isinstance(given[0], Indexed) else given[0]
        num_rows = len(to_numpy(first))
        batch = [
            checked_column(
                c, columns.get(c.name), num_rows, f"{table.value}.{c.name}", self._names.get((table, c.name))
            )
            for c in specs
        ]
        self._pending[table].append(batch)
        self._num_pending[table] += num_rows
        if self._num_pending[table] >= self.row_group_rows:
            self._flush(table)
        return num_rows

    def _flush(self, table: TraceTable) -> None:
        if not self._pending[table]:
            return
        names = {c.name: list(n.names) for c in TABLES[table] if (n := self._names.get((table, c.name)))}
        self._sink.submit(table, self._pending[table], names)
        self._num_rows[table] += self._num_pending[table]
        self._pending[table], self._num_pending[table] = [], 0

    def flush(self) -> None:
        """Write every buffered batch (returns once they are on disk)."""
        for table in TraceTable:
            self._flush(table)
        self._sink.drain()

    def close(self) -> None:
        """Flush, close the files (empty tables get an empty file with the schema), then write the metadata."""
        if self.is_closed:
            return
        self._sink.stop_thread()  # this thread writes the last groups itself
        for table in TraceTable:
            self._flush(table)
        self.is_closed = True
        written = self._sink.close()
        meta = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "fallbackgate_version": _package_version(),
            "closed_at": dt.datetime.now(dt.UTC).isoformat(),
            **self.metadata,
            "tables": {t.value: {"file": t.file_name, "rows": written[t]} for t in TraceTable},
        }
        tmp = self.directory / (METADATA_FILE + ".tmp")
        tmp.write_text(json.dumps(meta, sort_keys=True, default=_json_default))  # no indent: the C encoder
        tmp.replace(self.directory / METADATA_FILE)

    @property
    def sink_cpu_ns(self) -> int:
        """CPU ns the sink's own thread has spent converting and writing (beside the writing thread's)."""
        return self._sink.spent_cpu_ns

    @property
    def num_rows(self) -> dict[str, int]:
        """Rows written or buffered so far, per table."""
        return {t.value: self._num_rows[t] + self._num_pending[t] for t in TraceTable}

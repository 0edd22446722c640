"""Writing a trace directory: column batches in, Parquet row groups out, ``metadata.json`` on close.

Writers hand whole columns (numpy arrays, torch tensors, sequences) per call, never one access at a time;
batches are buffered per table and written as one row group once :attr:`TraceWriter.row_group_rows` rows
are waiting (and on :meth:`TraceWriter.close`). Metadata is written last, so a directory without
``metadata.json`` is a trace whose writer did not close.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fallbackgate.tracing.schema import (
    FORMAT_NAME,
    FORMAT_VERSION,
    METADATA_FILE,
    TABLES,
    VOCABULARIES,
    Column,
    TraceTable,
    arrow_schema,
)


class TraceFormatError(ValueError):
    """A trace (or a batch handed to a writer) does not match trace format v1; the message says where."""


def to_numpy(values: Any) -> Any:
    """A torch tensor as a numpy array (detached, on the CPU); anything else unchanged."""
    if hasattr(values, "detach"):  # a torch tensor, without importing torch here
        return values.detach().cpu().numpy()
    return values


def _dictionary(column: Column, values: Any, where: str) -> pa.Array:
    arr = np.asarray(values)
    if column.vocabulary:
        vocabulary = VOCABULARIES[column.vocabulary]
        if arr.dtype.kind in "iu":
            codes = arr.astype(np.int32)
            if codes.size and (codes.min() < 0 or codes.max() >= len(vocabulary)):
                raise TraceFormatError(f"{where}: codes must index {vocabulary}, got {codes.min()}..{codes.max()}")
        else:
            index = {name: i for i, name in enumerate(vocabulary)}
            names = [getattr(v, "value", v) for v in arr.tolist()]
            unknown = sorted({str(n) for n in names if n not in index})
            if unknown:
                raise TraceFormatError(f"{where}: unknown value(s) {unknown[:5]}; known: {vocabulary}")
            codes = np.fromiter((index[n] for n in names), dtype=np.int32, count=len(names))
        return pa.DictionaryArray.from_arrays(pa.array(codes, pa.int32()), pa.array(vocabulary, pa.string()))
    if arr.dtype.kind not in "USO":
        raise TraceFormatError(f"{where}: expected strings, got dtype {arr.dtype}")
    return pa.array(arr.astype(str), pa.string()).dictionary_encode()


def column_array(column: Column, values: Any, num_rows: int, where: str) -> pa.Array:
    """One column of a batch as an Arrow array of the column's type; raises TraceFormatError on bad input."""
    if values is None:
        if not column.is_nullable:
            raise TraceFormatError(f"{where}: is required")
        return pa.nulls(num_rows, column.type)
    values = to_numpy(values)
    if len(values) != num_rows:
        raise TraceFormatError(f"{where}: has {len(values)} rows, the batch's first column has {num_rows}")
    if pa.types.is_dictionary(column.type):
        return _dictionary(column, values, where)
    try:
        if isinstance(values, np.ma.MaskedArray):
            return pa.array(np.asarray(values.data), column.type, mask=np.ma.getmaskarray(values))
        return pa.array(values, column.type, from_pandas=False)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as exc:
        raise TraceFormatError(f"{where}: cannot be read as {column.type}: {exc}") from exc


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "value"):  # enums
        return value.value
    raise TypeError(f"metadata value {value!r} is not JSON")


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
        self._pending: dict[TraceTable, list[pa.RecordBatch]] = {t: [] for t in TraceTable}
        self._num_pending: dict[TraceTable, int] = dict.fromkeys(TraceTable, 0)
        self._num_rows: dict[TraceTable, int] = dict.fromkeys(TraceTable, 0)
        self._files: dict[TraceTable, pq.ParquetWriter] = {}
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
        num_rows = len(to_numpy(given[0]))
        arrays = [column_array(c, columns.get(c.name), num_rows, f"{table.value}.{c.name}") for c in specs]
        self._pending[table].append(pa.RecordBatch.from_arrays(arrays, schema=arrow_schema(table)))
        self._num_pending[table] += num_rows
        if self._num_pending[table] >= self.row_group_rows:
            self._flush(table)
        return num_rows

    def _flush(self, table: TraceTable) -> None:
        if not self._pending[table]:
            return
        if table not in self._files:
            self._files[table] = pq.ParquetWriter(self.directory / table.file_name, arrow_schema(table))
        group = pa.Table.from_batches(self._pending[table], schema=arrow_schema(table))
        self._files[table].write_table(group, row_group_size=max(group.num_rows, 1))
        self._num_rows[table] += group.num_rows
        self._pending[table], self._num_pending[table] = [], 0

    def flush(self) -> None:
        """Write every buffered batch."""
        for table in TraceTable:
            self._flush(table)

    def close(self) -> None:
        """Flush, close the files (empty tables get an empty file with the schema), then write the metadata."""
        if self.is_closed:
            return
        self.flush()
        for table in TraceTable:
            writer = self._files.pop(table, None) or pq.ParquetWriter(
                self.directory / table.file_name, arrow_schema(table)
            )
            writer.close()
        meta = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "fallbackgate_version": _package_version(),
            "closed_at": dt.datetime.now(dt.UTC).isoformat(),
            **self.metadata,
            "tables": {t.value: {"file": t.file_name, "rows": self._num_rows[t]} for t in TraceTable},
        }
        tmp = self.directory / (METADATA_FILE + ".tmp")
        tmp.write_text(json.dumps(meta, indent=2, sort_keys=True, default=_json_default))
        tmp.replace(self.directory / METADATA_FILE)
        self.is_closed = True

    @property
    def num_rows(self) -> dict[str, int]:
        """Rows written or buffered so far, per table."""
        return {t.value: self._num_rows[t] + self._num_pending[t] for t in TraceTable}

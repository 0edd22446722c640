"""Reading a trace directory back, with its version and every table's schema checked."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from fallbackgate.tracing.schema import FORMAT_NAME, FORMAT_VERSION, METADATA_FILE, TraceTable, arrow_schema
from fallbackgate.tracing.writer import TraceFormatError


@dataclasses.dataclass(slots=True)
class Trace:
    """One trace directory, read and checked."""

    path: Path  # the directory
    metadata: dict[str, Any]  # metadata.json as written
    tables: dict[TraceTable, pa.Table]  # every table, with its v1 schema

    def frame(self, table: TraceTable | str) -> pd.DataFrame:
        """A table as a pandas DataFrame (fixed-vocabulary strings as categoricals)."""
        return self.tables[TraceTable(table)].to_pandas()

    @property
    def workload(self) -> str:
        """The workload name the metadata gives, else the directory's name."""
        return str(self.metadata.get("workload") or self.path.name)


def _schema_differences(found: pa.Schema, expected: pa.Schema) -> list[str]:
    found_fields = {f.name: f for f in found}
    problems = [f"missing column {f.name} ({f.type})" for f in expected if f.name not in found_fields]
    problems += [f"unexpected column {name}" for name in found_fields if expected.get_field_index(name) < 0]
    for field in expected:
        other = found_fields.get(field.name)
        if other is not None and not other.type.equals(field.type):
            problems.append(f"column {field.name} is {other.type}, v1 says {field.type}")
    if not problems and found.names != expected.names:
        problems.append(f"columns out of order: {found.names}")
    return problems


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A trace directory's metadata, its format and version checked."""
    directory = Path(path)
    if not directory.is_dir():
        raise TraceFormatError(f"{directory}: not a trace directory (no such directory)")
    meta_path = directory / METADATA_FILE
    if not meta_path.is_file():
        raise TraceFormatError(f"{directory}: no {METADATA_FILE} (not a trace, or its writer did not close)")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceFormatError(f"{meta_path}: unreadable: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise TraceFormatError(f"{meta_path}: not a {FORMAT_NAME} metadata file")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        newer = isinstance(version, int) and version > FORMAT_VERSION
        why = "newer than this fallbackgate reads" if newer else "not a version this fallbackgate reads"
        raise TraceFormatError(f"{directory}: trace format version {version!r} is {why} (it reads {FORMAT_VERSION})")
    return meta


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """Read and check a trace directory; raises TraceFormatError naming the file and what is wrong."""
    directory = Path(path)
    meta = read_metadata(directory)
    tables: dict[TraceTable, pa.Table] = {}
    for table in TraceTable:
        file = directory / table.file_name
        if not file.is_file():
            raise TraceFormatError(f"{file}: missing (every v1 trace has all of {[t.value for t in TraceTable]})")
        try:
            data = pq.read_table(file)
        except (OSError, pa.ArrowException) as exc:
            raise TraceFormatError(f"{file}: not a readable Parquet file: {exc}") from exc
        problems = _schema_differences(data.schema, arrow_schema(table))
        if problems:
            raise TraceFormatError(f"{file}: does not match trace format v1: {'; '.join(problems)}")
        expected_rows = meta.get("tables", {}).get(table.value, {}).get("rows")
        if expected_rows is not None and expected_rows != data.num_rows:
            raise TraceFormatError(f"{file}: {data.num_rows} rows, metadata.json says {expected_rows} (truncated?)")
        tables[table] = data.cast(arrow_schema(table))
    return Trace(directory, meta, tables)

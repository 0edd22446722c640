"""The Parquet side of a :class:`~fallbackgate.tracing.writer.TraceWriter`: one thread that owns a trace's
files, turns buffered column batches into Arrow row groups and writes them, so neither the Arrow conversion
nor the file writes run on the thread that records (the engine's decode loop).

The writer hands over whole row groups (:meth:`ParquetSink.submit`) and returns at once; the files are opened
when the sink starts (while the run is still decoding), and :meth:`ParquetSink.close` writes what is queued,
closes every file (an empty table gets a file with its schema) and returns the rows written per table. Jobs
run one at a time in the order given; :meth:`ParquetSink.drain` and :meth:`ParquetSink.close` run what is
still queued on the caller's thread rather than wait for the sink's to be scheduled (on a loaded machine that
wait is the larger cost). An error on the sink's thread is raised, as :class:`TraceFormatError`, by the next
call on the writer's side.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from fallbackgate.tracing.schema import TABLES, VOCABULARIES, Column, TraceFormatError, TraceTable, arrow_schema

STATISTICS_COLUMNS = ("step", "request")  # the columns whose min/max each row group keeps, for readers that
# skip row groups by step or request; the others' (a fifth of a 128-token run's writing time) are left out
Part = tuple[np.ndarray, np.ndarray | None]  # one batch's data of one column and its null mask (None: no nulls)


def column_array(column: Column, parts: list[Part], where: str, names: Sequence[str] = ()) -> pa.Array:
    """The buffered parts of one column as one Arrow array of the column's type (``names``: the dictionary of
    a dictionary column without a fixed vocabulary)."""
    data = np.concatenate([d for d, _ in parts])
    masks = [m if m is not None else np.zeros(len(d), dtype=bool) for d, m in parts]
    mask = np.concatenate(masks) if any(m is not None for _, m in parts) else None
    try:
        if column.vocabulary or pa.types.is_dictionary(column.type):
            values = VOCABULARIES[column.vocabulary] if column.vocabulary else list(names)
            return pa.DictionaryArray.from_arrays(pa.array(data, pa.int32(), mask=mask), pa.array(values, pa.string()))
        return pa.array(data, column.type, mask=mask)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as exc:
        raise TraceFormatError(f"{where}: cannot be read as {column.type}: {exc}") from exc


class ParquetSink:
    """Writes one trace directory's Parquet files on its own thread."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._jobs: collections.deque[Callable[[], None]] = collections.deque()  # queued, in order
        self._wake = threading.Condition()  # guards _jobs and _stopping
        self._running = threading.Lock()  # held while a job runs: jobs never overlap
        self._stopping = False
        self._files: dict[TraceTable, pq.ParquetWriter] = {}
        self._rows: dict[TraceTable, int] = dict.fromkeys(TraceTable, 0)  # rows written per table
        self._error: BaseException | None = None  # the first failure of a job
        self.spent_cpu_ns = 0  # CPU ns the sink's own thread spent on jobs (those run on the caller's thread not
        # included: they are the caller's time)
        self._put(self._open_files)  # opened while the caller goes on recording
        self._thread = threading.Thread(target=self._run, name=f"trace-sink {directory.name}", daemon=True)
        self._thread.start()

    def submit(self, table: TraceTable, batches: list[list[Part]], names: dict[str, Sequence[str]]) -> None:
        """Queue one row group of ``table`` (per batch, per column (data, mask)); ``names``: by column name, the
        dictionary of each dictionary column without a fixed vocabulary, as of this group."""
        self.raise_error()
        self._put(lambda: self._write(table, batches, names))

    def drain(self) -> None:
        """Return once everything queued is written (running what is left on this thread)."""
        with self._running:
            while (job := self._take()) is not None:
                self._execute(job)
        self.raise_error()

    def stop_thread(self) -> None:
        """Let the sink's thread take no more jobs (what is queued, and queued later, waits for :meth:`close`):
        the caller is about to finish the writing itself, and waking the sink's thread would only make the two
        take turns."""
        with self._wake:
            self._stopping = True
            self._wake.notify()

    def close(self) -> dict[TraceTable, int]:
        """Write what is queued, close every file; returns the rows written per table. The sink's thread is
        stopped (a job it is running is waited for, not joined: it exits when next scheduled)."""
        self.stop_thread()
        with self._running:
            while (job := self._take()) is not None:
                self._execute(job)
            self._execute(self._close_files)
        self.raise_error()
        return dict(self._rows)

    def raise_error(self) -> None:
        """Raise a job's failure, if any, on the caller's thread."""
        if self._error is not None:
            if isinstance(self._error, TraceFormatError):
                raise self._error
            raise TraceFormatError(f"{self.directory}: writing the trace failed: {self._error}") from self._error

    def _put(self, job: Callable[[], None]) -> None:
        with self._wake:
            self._jobs.append(job)
            self._wake.notify()

    def _take(self) -> Callable[[], None] | None:
        with self._wake:
            return self._jobs.popleft() if self._jobs else None

    def _execute(self, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            self._error = self._error or exc

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._jobs and not self._stopping:
                    self._wake.wait()
                if self._stopping:
                    return
            with self._running:  # taken under the lock so that jobs run in order, one at a time
                if self._stopping:
                    return
                job = self._take()
                if job is not None:
                    started = time.thread_time_ns()
                    self._execute(job)
                    self.spent_cpu_ns += time.thread_time_ns() - started

    def _open_files(self) -> None:
        local = pafs.LocalFileSystem()  # given, so pyarrow does not resolve the path's filesystem per file
        for table in TraceTable:
            schema = arrow_schema(table)
            kept = [n for n in STATISTICS_COLUMNS if n in schema.names]
            path = str(self.directory / table.file_name)
            self._files[table] = pq.ParquetWriter(path, schema, filesystem=local, write_statistics=kept)

    def _write(self, table: TraceTable, batches: list[list[Part]], names: dict[str, Sequence[str]]) -> None:
        if self._error is not None:  # after a failure nothing more is written
            return
        arrays = [
            column_array(c, [b[k] for b in batches], f"{table.value}.{c.name}", names.get(c.name, ()))
            for k, c in enumerate(TABLES[table])
        ]
        group = pa.Table.from_arrays(arrays, schema=arrow_schema(table))
        self._files[table].write_table(group, row_group_size=max(group.num_rows, 1))
        self._rows[table] += group.num_rows

    def _close_files(self) -> None:
        for table in TraceTable:
            writer = self._files.pop(table, None)
            if writer is not None:
                writer.close()

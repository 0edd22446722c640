"""Trace format v1: round trip through TraceWriter and read_trace, clear errors for bad batches and bad
directories, the version check, and the README's field table against the schema definitions."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from fallbackgate.tracing import TABLES, TraceFormatError, TraceTable, TraceWriter, read_trace
from fallbackgate.tracing.schema import VOCABULARIES, markdown_table

README = Path(__file__).resolve().parents[1] / "README.md"


def _kv_batch(n: int, step: int) -> dict:
    rng = np.random.default_rng(step)
    return {
        "step": np.full(n, step), "request": np.array(["r0", "r1"])[np.arange(n) % 2],
        "layer": torch.arange(n, dtype=torch.int16) % 4, "block": np.arange(n), "content_hash": None,
        "tier_before": rng.integers(0, len(VOCABULARIES["tier"]), n), "tag": ["resident"] * n,
        "bytes": rng.integers(0, 1 << 20, n), "ns": rng.integers(0, 10**6, n),
    }  # fmt: skip


def test_round_trip_in_row_groups(tmp_path: Path) -> None:
    batches = [_kv_batch(7, step) for step in range(5)]
    with TraceWriter(tmp_path / "t", {"workload": "w", "model": {"num_layers": 4}}, row_group_rows=10) as writer:
        for batch in batches:
            writer.append("kv_access", **batch)
        writer.append(TraceTable.STEPS, step=[0, 1], phase=["prefill", "decode"], start_ns=[0, 5], end_ns=[5, 9],
                      batch=[2, 2], tokens=[30, 2])  # fmt: skip
    trace = read_trace(tmp_path / "t")
    assert trace.metadata["format_version"] == 1 and trace.metadata["model"] == {"num_layers": 4}
    assert trace.metadata["tables"]["kv_access"]["rows"] == 35
    assert pq.ParquetFile(tmp_path / "t" / "kv_access.parquet").num_row_groups == 3  # 14+14, then 7 on close
    kv = trace.frame("kv_access")
    expected_tiers = [VOCABULARIES["tier"][i] for b in batches for i in b["tier_before"]]
    assert kv["tier_before"].astype(str).tolist() == expected_tiers
    assert kv["bytes"].tolist() == [int(x) for b in batches for x in b["bytes"]]
    assert kv["layer"].tolist() == [i % 4 for _ in batches for i in range(7)]
    assert kv["content_hash"].isna().all()
    assert trace.frame("steps")["phase"].astype(str).tolist() == ["prefill", "decode"]
    for table in TraceTable:  # every table has its file, empty ones included, with the v1 schema
        assert trace.tables[table].schema.names == [c.name for c in TABLES[table]]
    assert trace.tables[TraceTable.IO].num_rows == 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tag": ["nonsense"] * 3}, "unknown value"),
        ({"tier_before": np.array([0, 1, 9])}, "codes must index"),
        ({"bytes": [1, 2]}, "has 2 rows"),
        ({"layer": ["a", "b", "c"]}, "cannot be read as int16"),
        ({"step": None}, "is required"),
        ({"bogus": [1, 2, 3]}, "unknown column"),
    ],
)
def test_bad_batches_name_the_column(tmp_path: Path, change: dict, message: str) -> None:
    with TraceWriter(tmp_path / "t", {}) as writer, pytest.raises(TraceFormatError, match=message):
        writer.append("kv_access", **{**_kv_batch(3, 0), **change})


def test_writer_refuses_a_used_directory(tmp_path: Path) -> None:
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "x").write_text("")
    with pytest.raises(TraceFormatError, match="new or empty"):
        TraceWriter(tmp_path / "t", {})


def _written(tmp_path: Path) -> Path:
    with TraceWriter(tmp_path / "t", {}) as writer:
        writer.append("kv_access", **_kv_batch(4, 0))
    return tmp_path / "t"


def test_schema_mismatch_is_named(tmp_path: Path) -> None:
    path = _written(tmp_path)
    table = pq.read_table(path / "kv_access.parquet")
    table = table.set_column(table.schema.get_field_index("bytes"), "bytes", table["bytes"].cast(pa.float64()))
    pq.write_table(table.drop_columns(["ns"]), path / "kv_access.parquet")
    with pytest.raises(TraceFormatError, match=r"kv_access.parquet.*missing column ns.*bytes is double"):
        read_trace(path)


def test_version_and_metadata_checks(tmp_path: Path) -> None:
    path = _written(tmp_path)
    meta = json.loads((path / "metadata.json").read_text())
    (path / "metadata.json").write_text(json.dumps({**meta, "format_version": 2}))
    with pytest.raises(TraceFormatError, match="version 2 is newer than this fallbackgate reads"):
        read_trace(path)
    (path / "metadata.json").write_text(json.dumps({**meta, "tables": {"kv_access": {"rows": 99}}}))
    with pytest.raises(TraceFormatError, match="4 rows, metadata.json says 99"):
        read_trace(path)
    (path / "metadata.json").write_text(json.dumps({**meta, "format": "other"}))
    with pytest.raises(TraceFormatError, match="not a fallbackgate-trace metadata"):
        read_trace(path)
    (path / "metadata.json").unlink()
    with pytest.raises(TraceFormatError, match="writer did not close"):
        read_trace(path)
    with pytest.raises(TraceFormatError, match="no such directory"):
        read_trace(tmp_path / "absent")


def test_missing_table_file(tmp_path: Path) -> None:
    path = _written(tmp_path)
    (path / "io.parquet").unlink()
    with pytest.raises(TraceFormatError, match="io.parquet: missing"):
        read_trace(path)


def test_readme_table_is_the_schema() -> None:
    text = README.read_text()
    found = re.search(r"<!-- trace-format-v1 -->\n(.*?)\n<!-- /trace-format-v1 -->", text, re.S)
    assert found, "README has no trace format v1 table"
    assert found.group(1).strip() == markdown_table()


def test_indexed_names_and_empty_rows(tmp_path: Path) -> None:
    from fallbackgate.tracing.writer import Indexed

    with TraceWriter(tmp_path / "t", {}, row_group_rows=2) as writer:
        writer.append("kv_access", **{**_kv_batch(3, 0), "request": Indexed(["z", "y"], np.array([1, 0, 1]))})
        writer.append("kv_access", **{**_kv_batch(2, 1), "request": ["q", "y"]})
        writer.append("requests", request=["a", "b"], request_class=["c", "c"], slo_ttft_ns=None,
                      slo_tpot_ns=[5, None], arrival_ns=[0, 0], first_token_ns=[None, 3], finish_ns=[None, None],
                      prompt_tokens=[1, 2], output_tokens=[0, 1])  # fmt: skip
        with pytest.raises(TraceFormatError, match="index must be 2 rows into 2 names"):
            writer.append("kv_access", **{**_kv_batch(2, 2), "request": Indexed(["z", "y"], np.array([0, 2]))})
        with pytest.raises(TraceFormatError, match="is required"):
            writer.append("kv_access", **{**_kv_batch(2, 2), "bytes": [1, None]})
    trace = read_trace(tmp_path / "t")
    assert trace.frame("kv_access")["request"].astype(str).tolist() == ["y", "z", "y", "q", "y"]
    requests = trace.frame("requests")
    assert requests["slo_tpot_ns"].tolist()[0] == 5 and requests["slo_tpot_ns"].isna().tolist() == [False, True]
    assert requests["finish_ns"].isna().all()


def test_a_write_failing_on_the_sink_is_raised_by_close(tmp_path: Path) -> None:
    writer = TraceWriter(tmp_path / "t", {}, row_group_rows=2)
    writer.append("kv_access", **{**_kv_batch(3, 0), "layer": np.array([1, 2, 70_000])})  # a group: sent to the sink
    with pytest.raises(TraceFormatError, match="kv_access.layer: cannot be read as int16"):
        writer.close()
    assert not (tmp_path / "t" / "metadata.json").exists()  # an unfinished trace is not one read_trace accepts


def test_kv_content_hash_column_follows_each_reads_blocks_in_every_layer() -> None:
    """Rows are layer-major per read; a block past the read's hashed ones (a partial tail) is null."""
    from fallbackgate.tracing.access_columns import KVPending

    pending = KVPending()
    pending.blocks += [3, 2, 1]
    pending.hashes += [[11, 12], [21, 22, 23], []]  # read 1 lists more hashes than blocks read: the first 2 count
    column = pending._hash_column(num_layers=2)
    assert column.mask.tolist() == [False, False, True] * 2 + [False, False] * 2 + [True] * 2
    assert column.data[~column.mask].tolist() == [11, 12, 11, 12, 21, 22, 21, 22]

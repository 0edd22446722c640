"""What the live trace's cheaper paths keep exact: the prefix cache's uint64 read hashes (kept per request,
hashed once per block), the steps rows handed on in batches, and the Parquet statistics kept only where
readers skip row groups (step, request)."""

from __future__ import annotations

import types
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from fallbackgate.assembly import Overrides, assemble, no_policy
from fallbackgate.bench.trace_overhead import _side
from fallbackgate.engine.kv import prefix_cache
from fallbackgate.engine.kv.prefix_cache import PrefixCache
from fallbackgate.engine.kv.prefix_types import chain_hashes, hash_u64
from fallbackgate.ledger.db import open_ledger
from fallbackgate.tracing import TraceTable, live, read_trace
from fallbackgate.tracing.schema import TABLES
from fallbackgate.tracing.sink import STATISTICS_COLUMNS

BLOCK_SIZE = 4


def _prefix_cache() -> PrefixCache:
    kv = types.SimpleNamespace(block_size=BLOCK_SIZE)
    return PrefixCache(kv, is_enabled=True, step_of=lambda: 0)  # type: ignore[arg-type]


def test_read_hashes_hash_each_block_once(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = _prefix_cache()
    seq = types.SimpleNamespace(request_id="r", all_token_ids=list(range(16)))
    hashed: list[bytes] = []
    monkeypatch.setattr(prefix_cache, "hash_u64", lambda digest: hashed.append(digest) or hash_u64(digest))
    for num_tokens in range(1, 17):  # one decode step after another, each reading every full block so far
        assert len(cache.read_hashes(seq, num_tokens)) == num_tokens // BLOCK_SIZE
    assert hashed == cache.chains["r"]  # four blocks, each hashed once, in order


def test_read_hashes_are_the_chain_hashes_as_uint64_and_copies() -> None:
    cache = _prefix_cache()
    seq = types.SimpleNamespace(request_id="r", all_token_ids=list(range(100, 118)))
    expected = [hash_u64(d) for d in chain_hashes(seq.all_token_ids, BLOCK_SIZE, 4, [])]
    assert cache.read_hashes(seq, 3) == []  # no full block yet
    first = cache.read_hashes(seq, 9)  # two full blocks, a partial third
    assert first == expected[:2]
    first.append(7)  # a capture keeps the list: the cache's own must not change with it
    assert cache.read_hashes(seq, 16) == expected
    assert cache.read_hashes(seq, 8) == expected[:2]  # an earlier position reads a prefix
    assert first == [*expected[:2], 7]
    cache.forget("r")
    assert "r" not in cache.chain_ids and "r" not in cache.chains
    other = types.SimpleNamespace(request_id="r", all_token_ids=list(range(200, 208)))  # the id reused
    assert cache.read_hashes(other, 8) == [hash_u64(d) for d in chain_hashes(other.all_token_ids, BLOCK_SIZE, 2, [])]


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A 9-token batch traced with steps rows handed on every 2 steps (the path long runs take; the steps kept
    to place I/O stay as they are)."""
    tmp = tmp_path_factory.mktemp("traced")
    built = assemble(no_policy(), Overrides(max_new_tokens=9))
    patch = pytest.MonkeyPatch()
    patch.setattr(live, "STEP_ROWS_PER_BATCH", 2)
    try:
        with open_ledger(f"sqlite:///{tmp / 'ledger.sqlite'}") as ledger:
            side = _side(built, ledger, "on", tmp / "trace")
    finally:
        patch.undo()
        built.engine.close()
    return tmp / "trace", int(side["steps"])


def test_steps_rows_handed_on_in_batches_are_every_step_in_order(traced: tuple[Path, int]) -> None:
    directory, num_steps = traced
    trace = read_trace(directory)
    steps = trace.frame("steps")
    assert len(steps) == num_steps == 9  # one prefill, eight decodes
    assert steps["step"].tolist() == sorted(steps["step"].tolist()) and steps["step"].is_unique
    assert steps["phase"].astype(str).tolist() == ["prefill"] + ["decode"] * 8
    assert (steps["end_ns"] > steps["start_ns"]).all() and (steps["batch"] == 8).all()
    assert steps["tokens"].iloc[1:].tolist() == [8] * 8
    expert_steps = set(trace.frame("expert_access")["step"])
    assert expert_steps == set(steps["step"])


def test_parquet_statistics_kept_for_step_and_request_only(traced: tuple[Path, int]) -> None:
    directory, _ = traced
    for table in TraceTable:
        metadata = pq.ParquetFile(directory / table.file_name).metadata
        for group in range(metadata.num_row_groups):
            row_group = metadata.row_group(group)
            kept = {row_group.column(i).path_in_schema for i in range(row_group.num_columns)
                    if row_group.column(i).is_stats_set}  # fmt: skip
            names = {c.name for c in TABLES[table]}
            assert kept == names & set(STATISTICS_COLUMNS), table

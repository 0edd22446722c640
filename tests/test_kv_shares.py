"""``python -m fallbackgate.bench.kv_shares``: the KV share of a ``trace simulate`` run's bytes, per configuration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fallbackgate.bench import kv_shares

MIB = 2**20
RESULT = {"controller": "static_split", "kv_bytes_scale": 8.0, "expert_fraction": 0.9, "budget_gib": 6 / 1024,
          "bytes_by_tag": {"exact_load": 30 * MIB, "kv_exact": 2 * MIB}, "spill_bytes": 6 * MIB,
          "prefetch_bytes": 2 * MIB, "num_unfit_gathers": 3, "stall_s": 0.25}  # fmt: skip


def test_kv_reads_and_spill_writes_over_every_byte_moved() -> None:
    assert kv_shares.kv_share(RESULT) == pytest.approx(8 / 40)  # (2 + 6) of 30 + 2 + 6 + 2
    assert kv_shares.kv_share({**RESULT, "bytes_by_tag": {}, "spill_bytes": 0, "prefetch_bytes": 0}) == 0.0


def test_one_line_per_configuration_and_bad_files_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "modelled-60.json"
    path.write_text(json.dumps([RESULT, {**RESULT, "error": "ValueError: no room"}]))
    assert kv_shares.main([str(path)]) == 0
    first, second = capsys.readouterr().out.splitlines()
    assert first.startswith("modelled-60 static_split KV x8 ") and "expert share 0.9" in first
    assert "unfit gathers     3  KV share 0.200  spill     6.0 MiB of    40.0  stall 0.25 s (modelled)" in first
    assert second.endswith("error: ValueError: no room")
    assert kv_shares.main([str(tmp_path / "missing.json")]) == 2 and "missing.json" in capsys.readouterr().err
    assert kv_shares.main([]) == 2

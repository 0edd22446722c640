"""`fallbackgate run` explains itself: SLO misses with measured and target times, ignored flags, the gate
table on PASS too, totals, the ledger and the next commands."""

from __future__ import annotations

import pathlib

import pytest

from fallbackgate.cli import main

POLICY = """
version: 1
controller: {kind: joint}
audit: {mode: enforce, sample_rate: 1.0}
classes:
  default:
    slo: {ttft_ms: 0.001, tpot_ms: 0.001}
"""


def test_summary_names_slo_misses_the_floor_and_where_to_look(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = tmp_path / "tiny-slo.yaml"
    policy.write_text(POLICY)
    ledger = tmp_path / "l.sqlite"
    args = ["run", "--policy", str(policy), "--ledger", str(ledger), "--quiet", "--max-new-tokens", "4"]
    assert main([*args, "--force", "expert_defer"]) == 0
    out, err = capsys.readouterr()
    assert "--force expert_defer is ignored" in err and "joint" in err
    assert "SLO default: 0 of 6 requests met TTFT <= 0.001 ms, TPOT <= 0.001 ms (measured)" in out
    assert "missed builtin-0: TTFT " in out
    assert "numeric floor (float32, exact vs exact): max KL" in out and "tolerance exact-only 1e-09" in out
    assert "run 1: PASS (6 of 6 requests audited); 24 tokens in" in out and "tokens/s" in out
    assert f"ledger: sqlite:///{ledger}" in out and f"fallbackgate gate --ledger sqlite:///{ledger} --run 1" in out
